"""matplotlib, which only the plots need: the `plot` extra (`pip install
'continuum-engine[plot]'`; `scripts/setup.sh plot`)."""

from __future__ import annotations

from types import ModuleType


def load_pyplot() -> ModuleType:
    """matplotlib's pyplot on the file-only Agg backend; ValueError saying how to install it
    where matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("plotting needs matplotlib: pip install 'continuum-engine[plot]' "
                         "(or bash scripts/setup.sh plot)") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot
