"""train.py's command line: its help text and the split of its arguments into config files,
flags and `--section.key=value` overrides (config.load reads the last two kinds)."""
from __future__ import annotations

from errors import ConfigError

USAGE = """\
usage: train.py [--config FILE]... [--section.key=value]... [--dry-run]
                [--resume CHECKPOINT] [--eval-only --checkpoint CHECKPOINT] [--check-channel]
GRPO for Qwen VLMs and LLMs: one torchrun launch, trainer ranks (FSDP2) + generation ranks (engines).
  --config FILE         a TOML config; repeatable, later files override earlier ones
                        (a preset after the base: --config configs/tiny.toml --config configs/presets/dapo.toml)
  --section.key=value   override one key (TOML syntax), e.g. --run.steps=5 --rollout.temperature=0.7
  --dry-run             print the resolved config, the rank plan and the groups; start nothing
  --resume CHECKPOINT   resume from this checkpoint (default: the newest intact one of run.out_dir)
  --eval-only --checkpoint CHECKPOINT   evaluate a saved checkpoint with the [eval] keys
  --check-channel       only time one sync.bucket_mb bucket over the weight channel; one JSON line
  -h, --help            this text
Precedence: defaults < config files in order < overrides. Every key is documented where it is
defined, in config.py (sections run, cluster, model, data, rollout, train, loss, reward, eval,
sync); docs/ has the metrics and examples.
  CPU demo: torchrun --standalone --nproc_per_node 3 train.py --config configs/tiny.toml
"""


def split_argv(argv: list[str]) -> tuple[list[str], dict, list[str]]:
    """train.py's arguments: (--config files in order, the other flags, the --section.key=value
    overrides); ConfigError for a flag that needs a value and has none."""
    configs, flags, overrides = [], {}, []
    it = iter(argv)
    for a in it:
        key, eq, val = a.partition("=")
        if key in ("--config", "--resume", "--checkpoint"):  # --config: repeatable
            val = val if eq else next(it, "")
            if not val or val.startswith("--"):
                raise ConfigError(f"{key} needs a value (see --help)")
            flags[key] = val
            configs += [val] if key == "--config" else []
        elif a in ("--dry-run", "--eval-only", "--check-channel"):
            flags[a] = True
        else:
            overrides.append(a)
    return configs, flags, overrides
