"""The `lra` console command's entry point (setup.py): `launch.cli.main`, with a Ctrl-C that
arrives while Python imports the command, or in a command that does not handle it, ended in
one line and exit status 130 instead of a traceback. `lra run` holds the signal itself from its
first line on (lra/signals.py `StartUp`)."""

from __future__ import annotations

import sys


def main() -> int:
  try:
    from launch import cli
    return cli.main()
  except KeyboardInterrupt:
    print("error: interrupted (Ctrl-C).", file=sys.stderr, flush=True)
    return 130


if __name__ == "__main__":
  sys.exit(main())
