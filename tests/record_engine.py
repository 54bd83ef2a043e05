"""A train.py rank whose engine records its calls (tests/test_colocate.py): run as train.py
is (`python tests/record_engine.py ARGS` or under torchrun); each rank writes the calls its
engine saw, and the train phases between them, to RUN_DIR/engine_calls_<rank>.json.

vLLM's CPU build makes sleep and wake_up no-ops, so their ORDER around every train phase is
checked here, on the calls themselves."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engines  # noqa: E402
import train  # noqa: E402
import update  # noqa: E402

CALLS: list[str] = []


class Recording:
    """Delegates everything to the engine; records generate, sleep, wake_up and load_weights."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _note(self, what: str) -> None:
        if not CALLS or CALLS[-1] != what:  # a call's repeats (each bucket's load) once
            CALLS.append(what)

    def generate(self, *a, **k):
        self._note("generate")
        return self._engine.generate(*a, **k)

    def sleep(self):
        self._note("sleep")
        return self._engine.sleep()

    def wake_up(self, tags=None):
        self._note("wake:" + ",".join(tags or ["all"]))
        return self._engine.wake_up(tags)

    def load_weights(self, named, adopt=False):
        self._note("load")
        return self._engine.load_weights(named, adopt)

    def receive_weights(self, source):  # the vLLM engine's colocated load (sync.GatheredSource)
        self._note("load")
        return self._engine.receive_weights(source)


def main() -> int:
    build, step = engines.build_engine, update.train_step
    engines.build_engine = lambda *a, **k: Recording(build(*a, **k))

    def train_step(*a, **k):
        CALLS.append("train")
        return step(*a, **k)
    update.train_step = train_step
    code = train.main(sys.argv[1:])
    out = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--run.out_dir="))
    Path(out, f"engine_calls_{os.environ.get('RANK', '0')}.json").write_text(json.dumps(CALLS))
    return code


if __name__ == "__main__":
    sys.exit(main())
