"""TensorFlow's start-up banner once per job, not twice per rank.

Importing TensorFlow 2.16 and later prints, before any Python code can set a log level, a notice
that oneDNN is on (``port.cc``; and, in some builds, the CPU feature notice of
``cpu_feature_guard.cc``), each preceded by absl's ``WARNING: All log messages before
absl::InitializeLog() is called are written to STDERR``.  TensorFlow prints them twice in every
process (two of its libraries log them) and ``TF_CPP_MIN_LOG_LEVEL`` does not reach them, so a job of
P ranks starts with 4 P such lines.  :class:`BannerFilter` passes the first of each and drops the
repeats from the job's standard error (``tfsparse-run`` runs mpirun's standard error through it;
``TFSPARSE_TF_BANNER=all`` keeps every line).  Nothing else is touched: a line is dropped only if
it is one of those notices, word for word, and was already shown.
"""
from __future__ import annotations

import os
import re
import select
import threading

#: absl's notice that logging is not yet initialised, printed before each pre-init message
ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
#: TensorFlow's start-up notices: an absl INFO line (``I0000 00:00:<time> <thread> <file>:<line>]
#: <text>``) from one of these files; group 1 is what makes it the same notice
_NOTICE = re.compile(r"I\d{4} \d\d:\d\d:[\d.]+ +\d+ ((?:port|cpu_feature_guard)\.cc:\d+\] .*)")


def _may_become_notice(partial: bytes) -> bool:
    """Whether an unfinished line could still turn out to be one of the notices."""
    text = partial.decode("utf-8", "replace")
    return ABSL_NOTICE.startswith(text) or re.fullmatch(r"I\d{0,4}( .*)?", text, re.S) is not None


class BannerFilter:
    """Feed bytes in, get the same bytes back less the repeated start-up notices.

    An unfinished line passes at once unless it could still become one of the notices (it starts
    as absl's notice or an absl INFO line does); such a line is held until its newline arrives
    (:meth:`feed`) or :meth:`flush` is called -- the pump calls it when no output has come for a
    moment.  A carriage return ends a line too (progress bars redraw one line with it)."""

    def __init__(self):
        self._seen: set[str] = set()
        self._partial = b""

    def _keep(self, line: bytes) -> bool:
        text = line.decode("utf-8", "replace").rstrip("\r\n")
        if text == ABSL_NOTICE:
            key = text
        else:
            match = _NOTICE.fullmatch(text)
            if match is None:
                return True
            key = match.group(1)
        if key in self._seen:
            return False
        self._seen.add(key)
        return True

    def feed(self, data: bytes) -> bytes:
        """What came so far (``data`` after what was held), less the repeats; an unfinished last
        line that could become a notice is held."""
        lines = re.split(b"(?<=[\n\r])", self._partial + data)
        last = lines.pop()
        self._partial = last if _may_become_notice(last) else b""
        out = b"".join(line for line in lines if self._keep(line))
        return out if self._partial or not last else out + last

    def flush(self) -> bytes:
        """The held unfinished line, if it is not a repeat."""
        line, self._partial = self._partial, b""
        return line if line and self._keep(line) else b""


def pump(source: int, sink: int, idle: float = 0.1) -> None:
    """Copies the file descriptor ``source`` to ``sink`` through a :class:`BannerFilter` until
    ``source`` ends, then closes ``source``; a held unfinished line goes out after ``idle``
    seconds without output.  When ``sink`` can no longer be written (its reader is gone), the
    rest is read and dropped, so the job never blocks on a full pipe."""
    broken = False

    def write(data: bytes) -> None:
        nonlocal broken
        while data and not broken:
            try:
                data = data[os.write(sink, data):]
            except OSError:  # the reader went away (a closed pipe): go on reading, so no rank blocks
                broken = True

    banner = BannerFilter()
    try:
        while True:
            ready, _, _ = select.select([source], [], [], idle)
            if not ready:
                write(banner.flush())
                continue
            data = os.read(source, 65536)
            if not data:
                break
            write(banner.feed(data))
        write(banner.flush())
    finally:
        os.close(source)


def filtered_stderr(env: dict) -> bool:
    """Whether the job's standard error goes through the filter (not with ``TFSPARSE_TF_BANNER=all``)."""
    return env.get("TFSPARSE_TF_BANNER", "once") != "all"


def start_pump(source: int, sink: int = 2) -> threading.Thread:
    """:func:`pump` on a daemon thread (a process that keeps the pipe open cannot hold the
    launcher); the caller joins it after the job ends, with a timeout."""
    thread = threading.Thread(target=pump, args=(source, sink), name="tfsparse-stderr", daemon=True)
    thread.start()
    return thread
