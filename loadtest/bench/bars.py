"""What every benchmark script here shares: its bars and its exit status.

A script states its bars up front, measures, prints each measured figure or ratio next to its
bar, and exits
  0  every bar met (or the script only reports figures and has no bar),
  1  a bar was missed,
  2  it could not measure: a setup error (a binary that did not build, a server that did not
     come up, a failed request, a missing tool).

    bars = Bars()
    bars.check("gateway ÷ NGINX requests/s", ratio, ">=", 0.8, unit="×")
    ...
    run(main)   # main() returns the Bars (or None when the script has none)
"""
import subprocess
import sys
import traceback

MET, MISSED, SETUP_ERROR = 0, 1, 2


class SetupError(Exception):
    """The benchmark could not measure; exit status 2."""


class Bars:
    """The bars of one run and whether each was met."""

    def __init__(self):
        self.rows = []

    def check(self, name, measured, op, bar, unit=""):
        """Record `measured op bar` (op is "<=", "<", ">=" or ">"); returns whether it holds."""
        ok = {"<=": measured <= bar, "<": measured < bar, ">=": measured >= bar, ">": measured > bar}[op]
        self.rows.append((name, measured, op, bar, unit, ok))
        return ok

    @property
    def met(self):
        return all(r[5] for r in self.rows)

    def print_table(self):
        if not self.rows:
            print("\nbars: none (this benchmark reports figures only)")
            return
        print("\n| bar | measured | met |")
        print("|---|---:|---|")
        for name, measured, op, bar, unit, ok in self.rows:
            sym = {"<=": "≤", ">=": "≥"}.get(op, op)
            print(f"| {name} {sym} {bar:g}{unit} | {measured:.2f}{unit} | {'yes' if ok else 'NO'} |")
        missed = [r[0] for r in self.rows if not r[5]]
        print(f"\nbars met: {'yes' if not missed else 'NO (' + '; '.join(missed) + ')'}")


def run(main, cleanup=None):
    """Run `main()` and exit with the status above; `cleanup()` runs whatever happens."""
    status = MET
    try:
        bars = main()
        if bars is not None:
            bars.print_table()
            status = MET if bars.met else MISSED
    except SetupError as e:
        print(f"setup error: {e}", file=sys.stderr)
        status = SETUP_ERROR
    except SystemExit as e:
        # sys.exit("message") from a helper: a setup error, not a missed bar.
        if e.code not in (None, 0):
            if not isinstance(e.code, int):
                print(f"setup error: {e.code}", file=sys.stderr)
            status = SETUP_ERROR
    except KeyboardInterrupt:
        status = SETUP_ERROR
    except (subprocess.CalledProcessError, OSError, AssertionError, RuntimeError, KeyError, ValueError):
        traceback.print_exc()
        print("setup error: the benchmark could not measure (see above)", file=sys.stderr)
        status = SETUP_ERROR
    finally:
        if cleanup is not None:
            cleanup()
    sys.exit(status)
