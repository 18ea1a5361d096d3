"""``VerdictFrame``: the table ``explain()`` returns, a pandas DataFrame that prints every reason whole.

pandas cuts a cell at ``display.max_colwidth`` (50 characters) when it prints a frame, so ``print(ctrl.explain())``
in a script showed ``selected as candidate #1 of 16: ready at weigh...``: every reason lost its point. This frame
(and every frame filtered from it) prints its cells in full, one row per line; the data is a plain DataFrame's.
"""

from __future__ import annotations

import pandas as pd

_FULL = ("display.max_colwidth", None, "display.expand_frame_repr", False)


class VerdictFrame(pd.DataFrame):
    @property
    def _constructor(self):
        return VerdictFrame

    def __repr__(self) -> str:
        with pd.option_context(*_FULL):
            return super().__repr__()

    def _repr_html_(self) -> str | None:
        with pd.option_context(*_FULL):
            return super()._repr_html_()

    def to_string(self, *args, **kwargs) -> str:
        kwargs.setdefault("max_colwidth", None)
        return super().to_string(*args, **kwargs)
