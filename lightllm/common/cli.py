"""What the command-line tools share."""

import argparse


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line, ``<prog>: error: <message>`` and exit code 2 (argparse's own
    print the whole usage first: a bad value's line is lost under a screenful of flags)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")
