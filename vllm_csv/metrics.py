"""Prometheus metrics of the CSV path, served on vLLM's own ``/metrics``.

The LM head runs in vLLM's worker processes, the ``/metrics`` endpoint in the API
server. prometheus-client's multiprocess mode joins them: every process writes its
samples to files in ``PROMETHEUS_MULTIPROC_DIR`` and the API server's registry reads
them all. vLLM enables that mode itself only with ``--api-server-count > 1``; with
CSV on, :func:`ensure_multiprocess_dir` (called once the flags are parsed, before the
engine processes start) enables it with vLLM's own helper for one API server too.
No metric exists unless CSV is enabled: they are created by the first head.

Tensor parallelism: every rank reaches the same decision for every row
(:mod:`vllm_csv.sharded`), so the families above count the deployment's rows once, from
rank 0, and the dashboard's sums stay right; the head time is rank 0's (the two collectives
of a CSV step keep the ranks in step). ``csv_decode_rank_rows_certified`` and
``csv_decode_rank_rows`` carry a ``rank`` label and are counted on every rank: equal counts
across ranks show the ranks agreed.
"""

from __future__ import annotations

import atexit
import bisect
import logging
import os
import threading
import time
import weakref

from .vocabulary import MODES  # the ``mode`` label of certified rows

logger = logging.getLogger("vllm.csv_decode")
PREFIX = "csv_decode"
SCORED_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 65536, 262144)
SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
# How stale /metrics may be. A step's counts are added up in process and written to Prometheus
# at most this often, by a daemon thread (and at exit): in multiprocess mode every update is a
# locked write to a memory-mapped file, 5 to 20 of them a step, which cost the serving loop more
# than the switched-off head's whole bookkeeping (issue 13, the off-switch's end-to-end promise).
FLUSH_SECONDS = 0.1


def ensure_multiprocess_dir() -> str | None:
    """Turn on prometheus-client's multiprocess mode in this (API server) process, as
    ``vllm serve --api-server-count N`` does, unless it is on already; returns the directory
    (None: metrics of the engine processes stay off).

    A ``PROMETHEUS_MULTIPROC_DIR`` that is set but cannot hold files (missing, not a directory,
    read-only) would crash vLLM's own metrics at start-up with a traceback; it is replaced by a
    fresh temporary directory, with one warning. Where no temporary directory can be made
    either, multiprocess mode is switched off (one warning): the server serves, vLLM's own
    metrics stay on ``/metrics``, and the LM head's (counted in the workers) do not reach it.
    The directory made here is removed when this process exits."""
    import atexit
    import shutil
    import tempfile

    from prometheus_client import values

    user = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if user:
        problem = unwritable(user)
        if problem is None:
            return user
    try:
        path = tempfile.mkdtemp(prefix="vllm-csv-prometheus-")
    except OSError as e:
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        values.ValueClass = values.MutexValue
        logger.warning("cannot create a metrics directory (%s): metrics of the engine processes, CSV-Decode's "
                       "included, are off%s", e.strerror or e,
                       f" (PROMETHEUS_MULTIPROC_DIR={user} is unusable: {problem})" if user else "")
        return None
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    values.ValueClass = values.get_value_class()  # metrics created from now on are file-backed
    if user:
        logger.warning("PROMETHEUS_MULTIPROC_DIR=%s is unusable (%s); metrics go to %s instead", user, problem, path)
    return path


def unwritable(path: str) -> str | None:
    """Why prometheus-client cannot keep its files in ``path`` (None: it can)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=path):
            return None
    except OSError as e:
        return e.strerror or str(e)


def ray_active() -> bool:
    """Whether this process is a Ray worker or driver (``ray.init`` done). There the metrics go
    to ``ray.util.metrics`` (vLLM's ``ray_wrappers``, as its ``RayPrometheusStatLogger``), which
    Ray's metrics agent exports from every node; the multiprocess files of a single host would
    not reach the API server from another node."""
    import sys

    ray = sys.modules.get("ray")  # never imported here: only a process that runs Ray has it
    return ray is not None and bool(getattr(ray, "is_initialized", lambda: False)())


def create_metrics(model_name: str, info: dict, rank: int | None = None) -> "CSVMetrics | None":
    """:class:`CSVMetrics` for this process, or None (one warning) where its multiprocess files
    cannot be created (the directory went missing or read-only after start-up): the head then
    serves without metrics rather than failing."""
    try:
        return CSVMetrics(model_name, info, rank=rank)
    except OSError as e:
        logger.warning("CSV-Decode metrics are off in this process: cannot create their files in "
                       "PROMETHEUS_MULTIPROC_DIR=%s (%s)", os.environ.get("PROMETHEUS_MULTIPROC_DIR"), e.strerror or e)
        return None


class _Batch:
    """Updates of Prometheus children added up in process and applied by :meth:`flush`
    (:data:`FLUSH_SECONDS`): the serving loop pays a dict update per value, not a file write."""

    def __init__(self):
        self.lock = threading.Lock()  # held by the caller around inc/observe (one step: one acquire)
        self._inc: dict = {}  # counter child -> amount
        self._obs: dict = {}  # histogram child -> observed values

    def inc(self, child, amount: float = 1.0) -> None:
        self._inc[child] = self._inc.get(child, 0.0) + amount

    def observe(self, child, values) -> None:
        self._obs.setdefault(child, []).extend(values)

    def flush(self) -> None:
        with self.lock:
            inc, obs, self._inc, self._obs = self._inc, self._obs, {}, {}
        for child, amount in inc.items():
            child.inc(amount)
        for child, values in obs.items():
            _observe_all(child, values)


def _observe_all(child, values: list[float]) -> None:
    """``child.observe(v)`` for every ``v``, as one update per bucket where the child is
    prometheus-client's histogram (its per-bucket counters and sum; what ``observe`` itself
    updates: ``tests/test_metrics.py`` checks the two agree), one call each otherwise (Ray)."""
    bounds, buckets, total = (getattr(child, a, None) for a in ("_upper_bounds", "_buckets", "_sum"))
    if bounds is None or buckets is None or total is None:
        for v in values:
            child.observe(v)
        return
    counts: dict[int, int] = {}
    for v in values:
        i = bisect.bisect_left(bounds, v)  # the first bucket with v <= bound (the last is +Inf)
        counts[i] = counts.get(i, 0) + 1
    total.inc(sum(values))
    for i, n in counts.items():
        buckets[i].inc(n)


class Series:
    """Steps counted as they come (:meth:`CSVMetrics.open_series`): one ``stats`` for all, a time
    each (None: a step not timed, counted but not in the head-time histogram)."""

    __slots__ = ("stats", "seconds", "done")

    def __init__(self, stats):
        self.stats, self.seconds, self.done = stats, [], 0


_live: "weakref.WeakSet[CSVMetrics]" = weakref.WeakSet()
_flusher: threading.Thread | None = None


def flush_all() -> None:
    """Write every pending update of this process's metrics (the flusher thread, and at exit)."""
    for m in list(_live):
        try:
            m.flush()
        except Exception as e:  # e.g. Ray's metrics after ray.shutdown(): the process is ending anyway
            logger.debug("CSV-Decode metrics flush failed: %s", e)


def _start_flusher() -> None:
    global _flusher
    if _flusher is not None and _flusher.is_alive():
        return

    def loop():
        while True:
            time.sleep(FLUSH_SECONDS)
            flush_all()

    _flusher = threading.Thread(target=loop, name="csv-decode-metrics", daemon=True)
    _flusher.start()


atexit.register(flush_all)


class CSVMetrics:
    """One set of metrics per process, labelled by ``model_name`` like vLLM's own. :meth:`record`
    adds a step's counts up in process; they reach Prometheus within :data:`FLUSH_SECONDS`
    (:meth:`flush`, from a daemon thread, and at exit)."""

    _families = None

    def __init__(self, model_name: str, info: dict, rank: int | None = None):
        self._batch = _Batch()
        fam = CSVMetrics._create()
        self.primary = not rank  # None (no TP) or rank 0: records the families without a rank label
        self.rank_rows = self.rank_certified = None
        if rank is not None:
            lab = {"model_name": str(model_name), "rank": str(rank)}
            self.rank_rows = fam["rank_rows"].labels(**lab)
            self.rank_certified = fam["rank_certified"].labels(**lab)
        self.labels = {"model_name": str(model_name)}
        m = self.labels
        self.steps = fam["steps"].labels(**m)
        self.rows = fam["rows"].labels(**m)
        self.csv_rows = fam["csv_rows"].labels(**m)
        self.certified = {mode: fam["certified"].labels(mode=mode, **m) for mode in MODES}
        from .head import FALLBACK_REASONS

        self.fallbacks = {r: fam["fallbacks"].labels(reason=r, **m) for r in FALLBACK_REASONS}
        self.scored = fam["scored"].labels(**m)
        self.fraction = fam["fraction"].labels(**m)
        self.seconds = fam["seconds"].labels(**m)
        self.saved = fam["saved"].labels(**m)
        self.csv_seconds = fam["csv_seconds"].labels(**m)
        self.dense_seconds = fam["dense_seconds"].labels(**m)
        self._warm: set[int] = set()  # batch sizes whose first CSV step was seen
        self._series: set[Series] = set()  # open series (open_series)
        self.vocab_size = int(info.get("vocab_size", 0)) or 1
        fam["info"].labels(**m, **{k: str(info.get(k, "")) for k in ("screen", "vocab_size", "hidden_size",
                                                                       "clusters", "fingerprint")}).set(1)
        _live.add(self)
        _start_flusher()

    @classmethod
    def _create(cls):
        if cls._families is None:
            if ray_active():  # a Ray worker: vLLM's wrappers of ray.util.metrics (same API)
                from vllm.v1.metrics.ray_wrappers import (RayCounterWrapper as Counter,
                                                          RayGaugeWrapper as Gauge,
                                                          RayHistogramWrapper as Histogram)
            else:
                from prometheus_client import Counter, Gauge, Histogram

            lab = ["model_name"]
            cls._families = {
                "steps": Counter(f"{PREFIX}_steps", "LM-head steps with at least one row on the CSV path", lab),
                "rows": Counter(f"{PREFIX}_rows", "Rows through the LM head (all sampling modes)", lab),
                "csv_rows": Counter(f"{PREFIX}_csv_rows", "Rows whose sampling mode CSV can certify", lab),
                "certified": Counter(f"{PREFIX}_rows_certified", "Rows certified on a sub-vocabulary, by sampling mode",
                                     lab + ["mode"]),
                "fallbacks": Counter(f"{PREFIX}_fallbacks", "Rows on the dense path, by reason", lab + ["reason"]),
                "scored": Histogram(f"{PREFIX}_scored_tokens", "Tokens scored exactly per certified row", lab,
                                    buckets=SCORED_BUCKETS),
                "fraction": Histogram(f"{PREFIX}_scored_fraction", "Share of the vocabulary scored per certified row",
                                      lab, buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)),
                "seconds": Histogram(f"{PREFIX}_head_seconds", "Time in the LM head per step (with rows for the sampler: and vLLM's sampler call)", lab,
                                     buckets=SECONDS_BUCKETS),
                "saved": Counter(f"{PREFIX}_head_seconds_saved",
                                 "Dense-head time (measured in place per batch size) minus CSV head time", lab),
                "csv_seconds": Counter(f"{PREFIX}_head_seconds_csv",
                                       "Head time of the steps that ran CSV (off-switch on, dense time known)", lab),
                "dense_seconds": Counter(f"{PREFIX}_head_seconds_dense_estimate",
                                         "The dense head's time measured in place, for the same steps", lab),
                "rank_rows": Counter(f"{PREFIX}_rank_rows", "Rows through this TP rank's LM head shard",
                                     lab + ["rank"]),
                "rank_certified": Counter(f"{PREFIX}_rank_rows_certified",
                                          "Rows certified, as decided on this TP rank", lab + ["rank"]),
                "info": Gauge(f"{PREFIX}_info", "CSV-Decode configuration of the served LM head",
                              lab + ["screen", "vocab_size", "hidden_size", "clusters", "fingerprint"],
                              multiprocess_mode="max"),
            }
        return cls._families

    def record(self, stats, dense_seconds: float | None = None, modes: dict[str, int] | None = None) -> None:
        """Count one step (a :class:`vllm_csv.head.StepStats`); ``modes`` splits
        ``stats.certified`` by sampling mode (default: all ``top_k``). Under tensor parallelism
        every rank counts its ``rank`` rows; only rank 0 counts the families without a rank."""
        with self._batch.lock:  # (the flusher thread swaps the batch out under it)
            self._record(self._batch, stats, dense_seconds, modes)

    def _record(self, b: _Batch, stats, dense_seconds: float | None, modes: dict[str, int] | None,
                seconds: list[float] | None = None) -> None:
        """One step, or with ``seconds`` one step of ``stats`` per time in it (a series)."""
        n = 1 if seconds is None else len(seconds)
        if self.rank_rows is not None:
            b.inc(self.rank_rows, n * stats.rows)
            if stats.certified:
                b.inc(self.rank_certified, n * stats.certified)
        if not self.primary:
            return
        b.inc(self.rows, n * stats.rows)
        if stats.csv_rows == 0:
            return
        b.inc(self.steps, n)
        b.inc(self.csv_rows, n * stats.csv_rows)
        modes = modes if modes is not None else {"top_k": stats.certified}
        if sum(modes.values()) != stats.certified:
            raise ValueError(f"certified rows by mode {modes} do not add up to {stats.certified}")
        for mode, k in modes.items():
            if k:
                b.inc(self.certified[mode], n * k)
        for reason, k in stats.fallbacks.items():
            if k:
                b.inc(self.fallbacks[reason], n * k)
        if stats.scored:
            b.observe(self.scored, stats.scored * n)
            b.observe(self.fraction, [s / self.vocab_size for s in stats.scored] * n)
        b.observe(self.seconds, (stats.seconds,) if seconds is None else [s for s in seconds if s is not None])
        # A step that ran CSV (not sent dense by the off-switch): time saved, and head speed-up =
        # dense / csv. A step the switch sent dense saved nothing (its dense run against the
        # dense estimate is noise). A batch size's first CSV step is left out of the speed-up
        # (first kernel calls, allocator growth). (The off-switch
        # charges it, but for the first off_switch.WARMUP_STEPS CSV steps of each kind.)
        if dense_seconds is not None and not stats.fallbacks.get("off_switch"):
            b.inc(self.saved, max(0.0, dense_seconds - stats.seconds))
            if stats.rows in self._warm:
                b.inc(self.csv_seconds, stats.seconds)
                b.inc(self.dense_seconds, dense_seconds)
            self._warm.add(stats.rows)

    def open_series(self, stats) -> "Series":
        """A run of steps alike but for their time (the plugin's fast lane of switched-off
        steps, :mod:`vllm_csv.vllm_plugin.lane`): the serving loop only appends each step's
        seconds (None: not timed) to the series' ``seconds``; each is counted as :meth:`record`
        would count ``stats`` with that time (one without: not in the head-time histogram), at every :meth:`flush` (so within :data:`FLUSH_SECONDS`, and
        at exit) and at :meth:`close_series`. ``stats`` may carry no certified rows and no
        off-switch account (a step the switch sent dense)."""
        if stats.certified:
            raise ValueError("a series counts dense steps only")
        s = Series(stats)
        with self._batch.lock:
            self._series.add(s)
        return s

    def close_series(self, s: "Series") -> None:
        """Count what is left of ``s`` and forget it."""
        with self._batch.lock:
            self._drain(s)
            self._series.discard(s)

    def _drain(self, s: "Series") -> None:  # (under the batch lock)
        # The serving thread only appends to s.seconds (atomic in CPython), and only this
        # method, under the lock, moves s.done: what it reads up to len() is complete.
        k = len(s.seconds)
        if k > s.done:
            self._record(self._batch, s.stats, None, None, s.seconds[s.done:k])
            s.done = k

    def flush(self) -> None:
        """Write the counts :meth:`record` added up since the last flush to Prometheus."""
        with self._batch.lock:
            for s in self._series:
                self._drain(s)
        self._batch.flush()
