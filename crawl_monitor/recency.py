"""Sources by when they were last asked about, the latest last: the recent ones without a pass over all.

The adaptive back-off keeps every source the regulator asked about in the last ten minutes
(at 400 one-URL sites a second, ~240,000) and each second wants those of the last few
seconds; a dict kept in the order of the asks gives them from its end.
"""
from __future__ import annotations


class Recency:
    """``ask`` moves a source to the end with its time; a time earlier than the last one (a clock
    stepped back) leaves the order unsure until ``older_than`` sorts it again, and meanwhile
    ``since`` reads all."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self._ordered = True

    def ask(self, source: str, at: float) -> None:
        if self.at:
            last = self.at[next(reversed(self.at))]
            self._ordered = self._ordered and at >= last
        self.at.pop(source, None)
        self.at[source] = at

    def since(self, cutoff: float) -> list[str]:
        """The sources asked about at or after ``cutoff``, sorted."""
        if not self._ordered:
            return sorted(s for s, at in self.at.items() if at >= cutoff)
        recent = []
        for source in reversed(self.at):
            if self.at[source] < cutoff:
                break
            recent.append(source)
        return sorted(recent)

    def older_than(self, cutoff: float) -> list[str]:
        """The sources last asked about before ``cutoff``, dropped."""
        if not self._ordered:
            self.at = dict(sorted(self.at.items(), key=lambda item: item[1]))
            self._ordered = True
        gone = []
        for source, at in self.at.items():
            if at >= cutoff:
                break
            gone.append(source)
        for source in gone:
            del self.at[source]
        return gone
