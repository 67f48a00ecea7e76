"""``gpuwatch`` as the documentation's examples see it: the real CLI, pointed at the fixture.

Adds ``--root FIXTURE`` to every command that takes ``--root`` and was not given one, gives a
bare ``watch --socket`` the fixture's socket path, and refuses ``--root /``: an example must
never act on the real host. Everything else is the real ``gpuwatch`` (tests/doc_examples.py).
"""

from __future__ import annotations

import argparse
import os
import sys

from gpuwatch.cli.main import build_parser, main


def subparser_for(argv: list[str]) -> tuple[argparse.ArgumentParser, int]:
    """The (sub)parser the words of argv select, and how many words selected it."""
    parser: argparse.ArgumentParser = build_parser()
    used = 0
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser = subs[0].choices[word]
        used += 1
    return parser, used


def rewrite(argv: list[str], root: str, sock: str) -> list[str]:
    parser, used = subparser_for(argv)
    args = list(argv)
    roots = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--root"]
    roots += [a.split("=", 1)[1] for a in args if a.startswith("--root=")]
    if any(os.path.normpath(os.path.abspath(r)) == "/" for r in roots):
        raise SystemExit("doc example: --root / would act on the real host; examples run "
                         "against a fixture")
    if "--root" in parser._option_string_actions and not roots:
        args[used:used] = ["--root", root]
    if args[:1] == ["watch"] and "--socket" in args:
        at = args.index("--socket")
        if at + 1 == len(args) or args[at + 1].startswith("-"):
            args.insert(at + 1, sock)
    return args


if __name__ == "__main__":
    argv = rewrite(sys.argv[1:], os.environ["GPUWATCH_DOC_ROOT"],
                   os.environ["GPUWATCH_DOC_SOCKET"])
    sys.exit(main(argv))
