"""``python -m services.prefill --help``: the prefill worker as its own process (as a container runs it).

Its command line is ``services.worker_cli``'s (``serve``'s engine flags plus the worker's own)."""

from services.lifecycle import run_app
from services.worker_cli import worker_app

app = worker_app("prefill")

if __name__ == "__main__":
    run_app(app)
