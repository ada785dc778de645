"""``python -m torch_kiln.audit`` / ``kiln-audit``: the command line."""

from __future__ import annotations

import argparse
import os
import sys

from torch_kiln.audit.api import AuditError, audit_script
from torch_kiln.audit.report import format_text, write_html, write_json

__all__ = ["main", "USAGE_ERROR"]

# Exit status when the audit itself cannot start (argparse uses it too).
USAGE_ERROR = 2


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0); got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds (a number > 0); got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m torch_kiln.audit",
        description="CUDA lock-in audit: read a PyTorch program and run it on kiln, then "
                    "list everything that ties it to CUDA, with the portable replacement. "
                    "The script's own output passes through unchanged; the report is written "
                    "to stderr (or --output) after the run, and the audit exits with the "
                    "script's exit status.",
        epilog="Everything after the script's name is passed to the script.")
    parser.add_argument("--map-cuda", action="store_true",
                        help='run with "cuda" devices, .cuda() and common torch.cuda calls '
                             "resolved to kiln, so an unmodified CUDA program runs")
    parser.add_argument("--timeout", type=_positive_seconds, metavar="SECONDS",
                        help="end the run after SECONDS (exit status 124); the report still "
                             "comes out")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the report as JSON (schema: docs/audit.md); - for stdout")
    parser.add_argument("--html", metavar="PATH",
                        help="also write a one-page HTML report to PATH")
    parser.add_argument("--output", metavar="PATH",
                        help="write the text report to PATH instead of stderr")
    parser.add_argument("--fix", nargs="?", const="-", metavar="PATH",
                        help="also write a unified diff (to PATH, or stdout with - or no PATH) "
                             "that rewrites the mechanical findings the portable way; files are "
                             "never edited (apply it with patch -p1 or git apply in --root). "
                             "Findings that need a decision are listed in its header")
    parser.add_argument("--no-run", action="store_true",
                        help="static findings only: read the source, do not run it")
    parser.add_argument("--root", metavar="DIR",
                        help="the user's source tree: imported modules under DIR are read, and "
                             "run-time findings are reported at lines under DIR "
                             "(default: the script's directory)")
    parser.add_argument("script", nargs="?", help="the Python script to audit")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


_WHAT_OPTIONS_WRITE = {"--fix": ("a unified diff", "fix.diff, or - for stdout"),
                       "--json": ("the JSON report", "audit.json, or - for stdout"),
                       "--html": ("the HTML report", "audit.html"),
                       "--output": ("the text report", "audit.txt")}


def _bad_output_path(option: str, path: str, script: str) -> str:
    """Why ``option PATH`` must not be written, or ``""``: the audit never
    overwrites a program's source (a Python file or the script itself), and
    a path whose directory does not exist is refused before the run, so that
    a long run is not lost to a typo."""
    what, example = _WHAT_OPTIONS_WRITE[option]
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return f"{option} {path!r}: directory {directory!r} does not exist"
    if path.endswith(".py") or (os.path.exists(script) and os.path.exists(path)
                                and os.path.samefile(path, script)):
        return (f"{option} {path!r}: that would overwrite a Python file; {option} writes "
                f"{what}, never the source: give a path such as {example}")
    if os.path.isdir(path):
        return f"{option} {path!r} is a directory; give the path of the file to write"
    return ""


def _write_fix(report, path: str, root: str | None) -> None:
    """Writes the --fix diff of ``report``'s files (torch_kiln/audit/fix.py)
    and says on stderr what it holds."""
    from torch_kiln.audit.fix import make_fix

    root = os.path.realpath(root or os.path.dirname(report.target))
    result = make_fix(report.files_scanned, root, report.findings)
    if path == "-":
        sys.stdout.flush()
        sys.stdout.write(result.diff)
        sys.stdout.flush()
        where = "the diff to stdout"
    else:
        with open(path, "w", encoding="utf-8", newline="") as handle:
            handle.write(result.diff)
        where = f"the diff to {path}"
    sys.stderr.write(f"kiln-audit --fix: wrote {where}: {len(result.fixed)} finding(s) "
                     f"rewritten in {len(result.files)} file(s), {len(result.unfixed)} listed "
                     f"as not rewritten, {len(result.skipped)} file(s) not patched; nothing "
                     "was edited\n")


def main(argv: list[str] | None = None) -> int:
    """Runs the command with ``argv`` (default ``sys.argv[1:]``); returns the
    exit status: the script's own, 124 after ``--timeout``, 1 for a script
    with a syntax error (not run), 0 with ``--no-run``, 2 if the audit could
    not start (bad option, missing script, a ``--fix`` path that is a Python
    file, an output path in a directory that does not exist). ``--fix`` writes its diff after the report (so with ``--fix -``
    and a run, it follows the script's own output on stdout)."""
    parser = build_parser()
    opts = parser.parse_args(argv)
    if opts.script is None:
        if opts.fix and opts.fix.endswith(".py"):
            parser.error(f"--fix takes the path of the diff to write (or -), and got the "
                         f"script {opts.fix!r}: write --fix - {opts.fix} (stdout) or "
                         f"--fix fix.diff {opts.fix}")
        parser.error("the following arguments are required: script")
    for option, path in (("--fix", opts.fix), ("--json", opts.json), ("--html", opts.html),
                         ("--output", opts.output)):
        writes_stdout = path == "-" and option in ("--fix", "--json")
        problem = _bad_output_path(option, path, opts.script) if path and not writes_stdout else ""
        if problem:
            parser.error(problem)
    try:
        report = audit_script(opts.script, opts.args, map_cuda=opts.map_cuda,
                              timeout=opts.timeout, run=not opts.no_run, root=opts.root)
    except (AuditError, FileNotFoundError) as error:
        print(f"kiln-audit: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    text = format_text(report)
    if opts.output:
        with open(opts.output, "w", encoding="utf-8") as handle:
            handle.write(text)
    else:
        sys.stdout.flush()
        sys.stderr.write("\n" + text)
    if opts.fix:
        _write_fix(report, opts.fix, opts.root)
    if opts.json:
        write_json(report, opts.json)
    if opts.html:
        write_html(report, opts.html)
    if report.run is None:
        return 1 if report.not_run_reason and not opts.no_run else 0
    status = report.run.get("exit_status")
    return 1 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
