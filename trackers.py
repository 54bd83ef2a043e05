"""The experiment trackers a run reports to (`run.report_to`): :class:`Trackers` over TensorBoard,
W&B and SwanLab, each package imported only when asked for; a tracker that fails mid-run is
dropped with one warning, never the run (docs/metrics.md, Trackers). What the run writes itself
(its record files, the console): tracking.py.
"""
from __future__ import annotations

import json
import math
import os
import sys
import warnings
from pathlib import Path

import config as C
from errors import one_line

DEFAULT_PROJECT = "grpo"  # W&B / SwanLab project unless the caller or the environment names one


class TrackerError(Exception):
    """A tracker could not start. The message is one line: `run.report_to: <name>: <why>`."""


class Trackers:
    """The open trackers of this run; with none, every call is a no-op (other ranks, CPU demo)."""

    def __init__(self, backends: list | None = None):
        self._live = list(backends or [])

    @property
    def names(self) -> list[str]:
        """The trackers still receiving calls."""
        return [b.name for b in self._live]

    @classmethod
    def open(cls, names: list[str], out_dir: Path | str, config: dict, run_name: str | None = None,
             project: str | None = None, start_step: int = 0, verbose: bool = False) -> "Trackers":
        """Start each named tracker (rank 0 only). `config` is the resolved config as a nested dict
        of sections. `start_step` > 0 marks a resumed run: TensorBoard then drops the earlier
        events at or after it. `verbose` (run.verbose): W&B prints its end-of-run history and
        summary block (off: only the run's link). Raises TrackerError naming the first tracker
        that fails; the ones already started are closed first."""
        for i, name in enumerate(names):
            if name not in C.TRACKERS:
                raise TrackerError(f"run.report_to: unknown tracker {name!r} "
                                   f"(choose from {', '.join(C.TRACKERS)})")
            if name in names[:i]:
                raise TrackerError(f"run.report_to: {name} is listed twice")
        out_dir, config = Path(out_dir), _plain(config)
        opened: list = []
        for name in names:
            try:
                opened.append(_BACKENDS[name](out_dir, config, run_name, project, start_step,
                                              verbose))
            except Exception as e:  # noqa: BLE001 - any start failure: one line naming the tracker
                for b in opened:
                    try:
                        b.close(failed=True)
                    except Exception:  # noqa: BLE001 - the first error is the one to show
                        pass
                raise TrackerError(f"run.report_to: {name}: {one_line(e, typed=False)}") from e
        return cls(opened)

    def log(self, metrics: dict[str, float], step: int) -> None:
        """One step's metrics (floats/ints; nan and inf allowed; keys may come and go)."""
        self._each("log", step, metrics, step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A few decoded samples of this step, one dict per row, e.g. {"index", "response",
        "reward", <reward parts>..., "version"}; a nested dict value (parts) becomes `key/sub`
        columns. Call it after `log(metrics, step)` of the same step (W&B drops earlier steps)."""
        rows = [_flatten(r, sep="/") for r in rows]
        if not rows:
            return
        columns = list(dict.fromkeys(k for r in rows for k in r))
        self._each("log_samples", step, step, columns, [[r.get(c) for c in columns] for r in rows])

    def close(self, failed: bool = False) -> None:
        """Flush and finish every live tracker; `failed=True` marks the run as crashed where the
        tracker has such a state (W&B exit code 1, SwanLab CRASHED). Safe to call twice."""
        self._each("close", None, failed=failed)
        self._live = []

    def _each(self, method: str, step: int | None, *args, **kwargs) -> None:
        for b in list(self._live):
            try:
                getattr(b, method)(*args, **kwargs)
            except (Exception, SystemExit) as e:  # noqa: BLE001 - a tracker never stops training
                self._live.remove(b)
                where = f"step {step}" if step is not None else "close"
                print(f"warning: tracker {b.name} failed at {where} ({method}): "
                      f"{one_line(e)}; no further calls to it",
                      file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- the three backends
class _TensorBoard:
    name = "tensorboard"

    def __init__(self, out_dir: Path, config: dict, run_name, project, start_step: int,
                 verbose: bool = False):
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ImportError as e:
            raise RuntimeError(f"package not installed ({one_line(e, typed=False)}); "
                               "pip install tensorboard") from e
        # flush_secs: the default 120 s makes a live dashboard lag two minutes behind.
        self.writer = SummaryWriter(log_dir=str(out_dir / "tensorboard"), flush_secs=10,
                                    purge_step=start_step or None)
        # Only the session-start record of the hparams plugin: without an experiment record,
        # TensorBoard offers every scalar tag as a metric column beside the hyperparameters.
        _, session_start, _ = hparams({k: _hparam(v) for k, v in _flatten(config).items()}, {})
        self.writer.file_writer.add_summary(session_start)
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", start_step)

    def log(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)

    def log_samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        self.writer.add_text("samples", _markdown_table(columns, rows), step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class _WandB:
    name = "wandb"

    def __init__(self, out_dir: Path, config: dict, run_name, project, start_step: int,
                 verbose: bool = False):
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError(f"package not installed ({one_line(e, typed=False)}); pip install wandb") from e
        self.wandb = wandb
        try:
            mode = os.environ.get("WANDB_MODE", "online")
            online = mode not in ("offline", "dryrun", "disabled")
            if online and not wandb.login(prompt=False, verify=False):  # reads keys, no network
                raise RuntimeError("no API key for online mode: set WANDB_API_KEY or run "
                                   "`wandb login`, or set WANDB_MODE=offline")
            out_dir.mkdir(parents=True, exist_ok=True)  # wandb makes <dir>/wandb/ but not <dir>
            project = project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT
            # quiet: no history / summary block at exit (the run's link still prints online)
            settings = None if verbose else wandb.Settings(quiet=True)
            self.run = wandb.init(dir=str(out_dir), name=run_name, config=config, project=project,
                                  settings=settings)
        except BaseException:
            # login()/init() set up a process-wide W&B state from the environment of the moment;
            # drop it so that a later start reads the environment afresh.
            wandb.teardown()
            raise

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        # One immutable table per step, like TRL: the UI steps through them with a slider.
        table = self.wandb.Table(columns=columns, data=rows, allow_mixed_types=True)
        self.run.log({"samples": table}, step=step)

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
        # finish() can return before wandb-core has written the last records; teardown waits for
        # it (wandb also calls it at exit, "not reliable in certain setups" says its docstring).
        self.wandb.teardown()


class _SwanLab:
    name = "swanlab"

    def __init__(self, out_dir: Path, config: dict, run_name, project, start_step: int,
                 verbose: bool = False):
        with warnings.catch_warnings():  # swanlab 0.6 imports the deprecated pynvml shim
            warnings.simplefilter("ignore", FutureWarning)
            try:
                import swanlab
                from swanlab.error import KeyFileError
                from swanlab.package import get_key
            except ImportError as e:
                raise RuntimeError(f"package not installed ({one_line(e, typed=False)}); "
                                   "pip install swanlab") from e
        mode = os.environ.get("SWANLAB_MODE", "cloud")
        if mode == "cloud":  # swanlab would otherwise ask on the terminal (and hang under torchrun)
            try:
                get_key()
            except KeyFileError:
                raise RuntimeError("no API key for cloud mode: set SWANLAB_API_KEY or run "
                                   "`swanlab login`, or set SWANLAB_MODE=offline") from None
        self.swanlab = swanlab
        # swanlab replaces the console streams' write (copying every line into its folder) and
        # the excepthook; what they were, to give them back when its finish fails
        self._console = ((sys.stdout, sys.stdout.write), (sys.stderr, sys.stderr.write), sys.excepthook)
        self.run = swanlab.init(
            project=project or os.environ.get("SWANLAB_PROJ_NAME") or DEFAULT_PROJECT,
            experiment_name=run_name, config=config, logdir=str(out_dir / "swanlog"))

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(self, step: int, columns: list[str], rows: list[list]) -> None:
        table = self.swanlab.echarts.Table().add(columns, [[_cell(v) for v in r] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self, failed: bool = False) -> None:
        from swanlab.data.run import SwanLabRunState
        try:
            if failed:
                self.run.finish(SwanLabRunState.CRASHED, error="training failed")
            else:
                self.run.finish()
        except BaseException:
            self._give_back_console()
            raise

    def _give_back_console(self) -> None:
        """A finish that failed (a full disk) leaves swanlab's console proxies in place, which
        copy every later line into its folder and fail there: the console is ours again."""
        (out, out_write), (err, err_write), hook = self._console
        out.write, err.write, sys.excepthook = out_write, err_write, hook


_BACKENDS = {"tensorboard": _TensorBoard, "wandb": _WandB, "swanlab": _SwanLab}


# ----------------------------------------------------------------------------- helpers
def _plain(x):
    """The config as JSON types only (paths, tuples, enums become str / list)."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def _flatten(d: dict, prefix: str = "", sep: str = ".") -> dict:
    """Nested dicts as one level: {"a": {"b": 1}} -> {"a.b": 1} (`sep` "/": "a/b")."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}{sep}", sep))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _hparam(v):
    """TensorBoard's hparams take numbers, strings and bools; lists are shown as text."""
    return v if v is None or isinstance(v, (bool, int, float, str)) else json.dumps(v)


def _cell(v):
    """SwanLab's table is JSON: a non-finite float would be written as null."""
    return str(v) if isinstance(v, float) and not math.isfinite(v) else v


_MD_ESCAPE = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", "|": "\\|", "\\": "\\\\",
                            "*": "\\*", "_": "\\_", "`": "\\`", "[": "\\[", "]": "\\]",
                            "#": "\\#", "\n": "<br>", "\r": ""})


def _markdown_table(columns: list[str], rows: list[list]) -> str:
    """A markdown table whose cells show the model's text literally: `<answer>` stays visible
    instead of being taken as HTML, and `*`, `_`, `|` as written."""
    def cell(v) -> str:
        if isinstance(v, float):
            v = f"{v:.4g}"
        return str(v).translate(_MD_ESCAPE)
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)
