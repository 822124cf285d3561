"""`python -m selfevo ...`: the `selfevo` command (where the venv's scripts are not on PATH)."""

from selfevo.cli import app

app(prog_name="selfevo")
