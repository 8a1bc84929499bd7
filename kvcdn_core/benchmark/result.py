"""What a benchmark run measured: one row per context length and scheme, and the run around them."""

from __future__ import annotations

import dataclasses

#: Timed columns whose min and max are reported next to the median (``--format json``: ``spread``).
TIMED = (
    "prefill_s",
    "kv_attn_s",
    "question_s",
    "plain_read_s",
    "load_s",
    "load_unverified_s",
    "ttft_cached_s",
    "ttft_pipelined_s",
)


@dataclasses.dataclass
class BenchRow:
    """One CSV row (a length and a scheme) plus what the CSV leaves out (plain read, checks)."""

    tokens: int
    prefill_s: float
    kv_attn_s: float
    kv_mb: float
    prefill_gflops: float
    speedup_compute: float
    scheme: str
    load_s: float
    load_gbps: float
    ttft_cached_s: float
    speedup_ttft: float
    artifact_bytes: int
    plain_read_s: float
    question_s: float
    ttft_pipelined_s: float
    threads: int
    load_unverified_s: float = 0.0  # the same load without the sha256 check: what hashing costs
    first_token_match: bool | None = None
    spread: dict[str, tuple[float, float, float]] = dataclasses.field(default_factory=dict)
    model: str = ""  # the model reference the run loaded (the CSV's last column; plot titles name it)

    @property
    def plain_read_gbps(self) -> float:
        return self.artifact_bytes / self.plain_read_s / 1e9 if self.plain_read_s > 0 else 0.0

    @property
    def load_read_ratio(self) -> float:
        """How far the load is from reading its bytes (1.0: at the limit)."""
        return self.load_s / self.plain_read_s

    @property
    def ttft_limit_s(self) -> float:
        """What a cached first token cannot beat: the slower of reading the file and the question's
        forward on a resident cache (a pipelined load overlaps the two)."""
        return max(self.plain_read_s, self.question_s)

    @property
    def speedup_pipelined(self) -> float:
        return self.prefill_s / self.ttft_pipelined_s


@dataclasses.dataclass
class BenchResult:
    rows: list[BenchRow]
    page_cache: str  # how loads were made cold, in words
    page_cache_method: str  # drop_caches | fadvise | none
    max_resident_after_drop: float | None  # worst fraction of a file still cached after a drop
    context_source: str
    threads: int = 0  # torch intra-op threads the run used
    load_average: tuple[float | None, float | None] | None = None  # 1-minute load average at the start and the end
