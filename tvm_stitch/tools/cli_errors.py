"""How the command line answers a user's mistake: one line on stderr and exit status 2.

A user's mistake is an exception of a type that blames the input (UserInputError and its kinds,
a file that is missing, unreadable or of the wrong kind); any other exception is a bug in
tvm-stitch and keeps its traceback."""

from __future__ import annotations

import argparse
import sys

from tvm_stitch.errors import UserInputError

USER_ERRORS = (UserInputError, FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError)
USAGE_STATUS = 2


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser (its subcommands' too) with its errors on one line: the message and where
    the usage is, not the usage itself."""

    def error(self, message: str):
        self.exit(USAGE_STATUS, f"{self.prog}: {' '.join(message.split())} (see {self.prog} --help)\n")


def run_command(command: str, func, args) -> int:
    """`func(args)`'s exit status; a user's mistake printed as one line, status 2."""
    try:
        return func(args)
    except USER_ERRORS as err:
        print(f"tvm-stitch {command}: {one_line(err)}", file=sys.stderr)
        return USAGE_STATUS


def one_line(err: BaseException) -> str:
    """The error's message on one line (TVM's messages span several)."""
    text = " ".join(str(err).split())
    return text or type(err).__name__


def at_least(value, least, option: str) -> None:
    """UserInputError unless `value` >= `least`."""
    if value < least:
        raise UserInputError(f"{option} must be at least {least}, not {value}")
