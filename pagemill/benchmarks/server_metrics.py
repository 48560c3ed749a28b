"""Read a pagemill server's speculative decoding counters from its /metrics page (for `bench serve`)."""

from __future__ import annotations

from pagemill.metrics.stats import SpecDecodingStats

_PREFIX = "pagemill:spec_decode_"


def parse_spec_counters(text: str) -> SpecDecodingStats | None:
    """The pagemill:spec_decode_* counters of a Prometheus text page (summed over models); None if absent."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(_PREFIX):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            name = family.name[len(_PREFIX):]
            if name == "num_accepted_tokens_per_pos":
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
            else:
                totals[name] = totals.get(name, 0.0) + sample.value
    if "num_drafts" not in totals:
        return None
    positions = [int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)] if per_pos else []
    return SpecDecodingStats(num_spec_tokens=len(positions), num_drafts=int(totals["num_drafts"]),
                             num_draft_tokens=int(totals.get("num_draft_tokens", 0)),
                             num_accepted_tokens=int(totals.get("num_accepted_tokens", 0)),
                             num_accepted_tokens_per_pos=positions)


async def fetch_spec_counters(base_url: str) -> SpecDecodingStats | None:
    """The server's counters now; None when it has none (no speculation, not pagemill) or /metrics fails."""
    import aiohttp

    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            async with session.get(base_url.rstrip("/") + "/metrics") as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
    except (aiohttp.ClientError, OSError, TimeoutError):
        return None
    try:
        return parse_spec_counters(text)
    except ValueError:  # not a Prometheus page
        return None
