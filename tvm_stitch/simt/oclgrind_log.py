"""Oclgrind's diagnostics turned into SIMT statuses.

Oclgrind (an OpenCL device simulator) prints one paragraph per problem:
a headline ("Invalid write of size 4 at global memory address ...",
"Read-write data race at local memory address ...", "Uninitialized value
read from ...", "Work-group divergence detected (barrier)") followed by
indented lines naming the kernel, the work-item and the source line.
`OCLGRIND_ENV` holds the settings that turn on its race and uninitialised
value checks; they are read when an Oclgrind context is created.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

OCLGRIND_ENV = MappingProxyType({"OCLGRIND_DATA_RACES": "1", "OCLGRIND_UNINITIALIZED": "1"})

# (status, headline pattern), first match wins
_KINDS = (
    ("out-of-bounds", re.compile(r"^Invalid (read|write)")),
    ("race", re.compile(r"data race|divergence", re.IGNORECASE)),
    ("uninitialised", re.compile(r"^Uninitiali[sz]ed", re.IGNORECASE)),
)
_ADDRESS = re.compile(r"0x[0-9a-f]+")


@dataclass(frozen=True)
class Finding:
    status: str  # out-of-bounds | race | uninitialised | unsupported (a fatal error of the simulator)
    headline: str  # with addresses removed, so that repeats of one problem compare equal
    where: str  # the source line Oclgrind quotes, if any
    count: int  # how many work-items reported it


def parse(log: str) -> list:
    """The distinct problems in an Oclgrind log, most frequent first."""
    found = {}
    for paragraph in re.split(r"\n\n+", log):  # blank lines inside a report hold a tab
        lines = [line for line in paragraph.splitlines() if line.strip()]
        if not lines:
            continue
        headline = lines[0].strip()
        if headline.startswith("OCLGRIND FATAL ERROR"):
            status = "unsupported"
            headline = " ".join(line.strip() for line in lines[:2])
        else:
            status = next((s for s, pattern in _KINDS if pattern.search(headline)), None)
            if status is None:
                continue
        where = " / ".join(_place(lines, i) for i, line in enumerate(lines) if line.strip().startswith("At line"))
        key = (status, _ADDRESS.sub("ADDR", headline), where)
        found[key] = found.get(key, 0) + 1
    ordered = sorted(found.items(), key=lambda item: -item[1])
    return [Finding(status, headline, where, count) for (status, headline, where), count in ordered]


def _place(lines: list, i: int) -> str:
    """'line N: <source>' for the "At line N (column C) of input.cl:" line at `i` (source when quoted)."""
    match = re.match(r"At line (\d+)", lines[i].strip())
    code = lines[i + 1].strip() if i + 1 < len(lines) else ""
    code = "" if code.startswith("(source not available)") else f": {code[:160]}"
    return f"line {match.group(1)}{code}" if match else lines[i].strip()
