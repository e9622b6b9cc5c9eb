"""`python -m kb.cli ...` is `kb ...`: how a backend starts a job's process with this interpreter."""
from kb.cli import run

run()
