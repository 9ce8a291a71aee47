"""The soak's twelve scenarios (`tests/multigpu/test_soak.py`), interleaved round after round,
on emulated ranks of one GPU (`Buffer.emulated`, a stream per rank): six Buffers at once, three
formats, empty ranks, skip_a2a, the fused shared expert. Each scenario's first round is checked
against the reference in full; every later round must reproduce its checksum exactly, and at
the end every stream a rank sent on was consumed by its peer, the round counters equal the calls
and no memory was left allocated."""

from __future__ import annotations

import random

import pytest
import torch

from tests.multigpu.test_soak import (HIDDEN, MAX_TOKENS, TOPK, EXPERTS, _round_checksum,
                                      buffer_counters, check_results, dispatch_combine,
                                      prepare, verify_first_round)

pytestmark = pytest.mark.gpu

ROUNDS = 300


@pytest.mark.parametrize("ranks,sms", [(4, 24), (8, 16)])
def test_emulated_soak_of_every_scenario_interleaved(ranks, sms):
    from cute_ep.ep import Buffer
    from layouts import EPConfig

    device_sms = torch.cuda.get_device_properties(0).multi_processor_count
    if ranks * sms > device_sms:
        pytest.skip(f"{ranks} ranks x {sms} SMs do not fit this GPU's {device_sms} SMs")
    groups = {(fmt, shared): Buffer.emulated(
        EPConfig(HIDDEN, TOPK, EXPERTS, ranks, MAX_TOKENS, fmt, shared), timeout_s=20.0,
        sms=sms) for fmt in ("bf16", "fp8", "nvfp4") for shared in (False, True)}
    prepared = prepare({k: g[0].cfg for k, g in groups.items()}, ranks, range(ranks))
    streams = [torch.cuda.Stream() for _ in range(ranks)]
    torch.cuda.synchronize()  # the ranks' streams read what the default stream wrote

    def layer(s):
        """Scenario s on every rank, each on its own stream, nothing synchronised between."""
        done = []
        for r in range(ranks):
            with torch.cuda.stream(streams[r]):
                done.append(dispatch_combine(groups[prepared[s][r]["key"]][r], prepared[s][r]))
        return done

    for s in range(len(prepared)):
        results = layer(s)
        torch.cuda.synchronize()
        for r, (out, combined) in enumerate(results):
            group = groups[prepared[s][r]["key"]]
            group[r].check()
            verify_first_round(group[r], prepared[s][r], out, combined)
    del results, out, combined
    wrong = [torch.zeros((), dtype=torch.int64, device="cuda") for _ in range(ranks)]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    order = random.Random(11).choices(range(len(prepared)), k=ROUNDS)
    for s in order:
        for r, (out, combined) in enumerate(layer(s)):
            p = prepared[s][r]
            with torch.cuda.stream(streams[r]):
                cfg = groups[p["key"]][r].cfg
                wrong[r] += (_round_checksum(cfg, out, combined) != p["checksum"]).any()
            del out, combined
    torch.cuda.synchronize()
    for group in groups.values():
        for buf in group:
            buf.check()
    after = torch.cuda.memory_allocated()
    check_results([{"wrong": int(wrong[r]), "first_wrong": None, "before": before,
                    "after": after,
                    "counters": buffer_counters({k: g[r] for k, g in groups.items()}, ranks,
                                                order)}
                   for r in range(ranks)], ranks)
