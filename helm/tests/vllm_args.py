"""Parse engine argument lists with the installed vLLM's own `vllm serve` parser.

Run with the Python of the vLLM that scripts/setup-vllm.sh installs: reads a JSON list of
argument lists on stdin (what the chart renders for `engine.kind: vllm`), parses each as
`vllm serve` would, and prints one JSON line: the vLLM version and, for each list, null or
what argparse said about it. A flag vLLM does not know, or a value it refuses, is caught here
rather than in a crash-looping pod.
"""

import contextlib
import importlib.metadata
import io
import json
import sys

from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser


def refusal(args):
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parser.parse_args(args)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "refused"
    return None


def main():
    lists = json.load(sys.stdin)
    print(json.dumps({"vllm": importlib.metadata.version("vllm"), "refusals": [refusal(a) for a in lists]}))


if __name__ == "__main__":
    main()
