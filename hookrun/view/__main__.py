"""`python -m hookrun.view RUN_DIR [--out DIR]`: the static pages of a features run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hookrun.errors import HookrunError
from hookrun.view.site import write_view

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m hookrun.view` (the CLI reference prints its help).

    Returns:
        The parser of a run folder and --out.
    """
    cli = argparse.ArgumentParser(
        prog="python -m hookrun.view",
        description="Write the static pages (an index, a page per unit) of a features run "
        "(experiment=features): they open from file:// with no network.",
    )
    cli.add_argument("run_dir", metavar="RUN_DIR", help="the run folder holding captures.h5")
    cli.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the view's folder (default: RUN_DIR/view; an older view there is replaced)",
    )
    return cli


def main(argv: list[str] | None = None) -> int:
    """Write the view of one run and print where its index is.

    Args:
        argv: The command line's arguments; None reads sys.argv.

    Returns:
        The exit status: 0 once written, 2 for bad input, 1 for a failed write (one line
            on stderr).
    """
    cli = parser()
    try:
        args = cli.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as stop:  # argparse's usage error: exit status 2
        return int(stop.code or 0)
    try:
        result = write_view(Path(args.run_dir), args.out)
    except HookrunError as err:
        print(f"hookrun.view: error: {err}", file=sys.stderr)
        return err.exit_code
    except OSError as err:  # the disk full, a folder not writable: the old view kept
        print(f"hookrun.view: error: {err}", file=sys.stderr)
        return 1
    print(f"view: {result.index} ({result.sites} sites, {result.pages} unit pages)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
