"""How many cases the hypothesis fuzz tests run: sized for CI by default; `KB_FUZZ_EXAMPLES=10000`
(or `pytest --long`, which sets it) for a long run."""
import os


def examples(default):
    return int(os.environ.get("KB_FUZZ_EXAMPLES", default))
