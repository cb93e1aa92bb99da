"""The `lra` console command's entry point (setup.py): `launch.cli.main`, with a Ctrl-C that
arrives while Python imports the command, or in a command that does not handle it, and a
SIGTERM that arrives while Python imports the command, ended in one line and exit status 130
instead of a traceback or a silent kill. `lra run` holds the signal itself from its
first line on (lra/signals.py `StartUp`).

It also sizes XLA:CPU's thread pool when several CPU devices are asked for
(`lra.cpus.cpu_threads`)."""

from __future__ import annotations

import os
import signal
import sys

from lra.cpus import cpu_threads

IMPORT_SIGTERM = ("error: interrupted by SIGTERM while the command was starting; nothing was "
                  "done: rerun the same command.")


def _sigterm_while_importing(signum, frame) -> None:
  del signum, frame
  print(IMPORT_SIGTERM, file=sys.stderr, flush=True)
  os._exit(130)


def main() -> int:
  cpu_threads()
  # A SIGTERM while the command's modules load (seconds on a busy machine) ends the process in
  # one line too; the signal's previous action is back before the command runs, and `lra run`
  # then holds it itself (lra/signals.py StartUp). A SIGTERM ignored by the parent stays ignored.
  previous = signal.getsignal(signal.SIGTERM)
  if previous is not signal.SIG_IGN:
    signal.signal(signal.SIGTERM, _sigterm_while_importing)
  try:
    from launch import cli
  except KeyboardInterrupt:
    # Nothing has run yet, so the process ends here, without Python's exit: once, after an
    # import cut short and this line, the process still ended by SIGINT (status -2, not 130).
    print("error: interrupted (Ctrl-C).", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(130)
  if previous is not signal.SIG_IGN:
    signal.signal(signal.SIGTERM, previous)
  try:
    return cli.main()
  except KeyboardInterrupt:
    print("error: interrupted (Ctrl-C).", file=sys.stderr, flush=True)
    return 130


if __name__ == "__main__":
  sys.exit(main())
