"""``python -m services.prefill --help``: the prefill worker as its own process (as a container runs it)."""

from services.worker_cli import worker_app

app = worker_app("prefill")

if __name__ == "__main__":
    app()
