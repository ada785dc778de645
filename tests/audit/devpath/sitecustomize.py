"""Test-only import shim: ``torch_kiln.audit`` comes from *this* checkout.

Why: ``pip install -e`` of kiln (scikit-build-core's "redirect" mode) puts a
finder in ``sys.meta_path`` that serves ``torch_kiln`` from the checkout it
was installed from, ahead of ``PYTHONPATH``. Testing the audit in another
clone (without rebuilding, and without repointing everyone's install) needs
its ``torch_kiln.audit`` to win while the rest of ``torch_kiln`` — with its
built ``_C`` — stays the installed one. The audit is pure Python, so that
mix is sound.

How: Python imports ``sitecustomize`` at start-up from ``sys.path``; the
audit tests put this directory on ``PYTHONPATH`` for every interpreter they
start (the audit command, and the child process it starts for the user's
script, inherit it), and import this file into the test process itself.
The finder below answers only for ``torch_kiln.audit``; its submodules are
then found through that package's ``__path__``. In a checkout that is the
installed one it serves the same files, so it is harmless there.
"""

import importlib.util
import os
import sys

AUDIT_DIR = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                          "..", "..", "..", "torch_kiln", "audit"))


class AuditFromThisCheckout:
    """Meta-path finder serving ``torch_kiln.audit`` from :data:`AUDIT_DIR`."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch_kiln.audit":
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(AUDIT_DIR, "__init__.py"),
            submodule_search_locations=[AUDIT_DIR])


if not any(isinstance(f, AuditFromThisCheckout) for f in sys.meta_path):
    sys.meta_path.insert(0, AuditFromThisCheckout())
