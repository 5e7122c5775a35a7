"""FlexDeMo(link_budget="auto") on 4 real CPU ranks (torchrun, gloo): dist_link_budget.py does
the checks."""

import json

from torchrun import succeeded, torchrun


def test_link_budget_choices_and_resume(tmp_path):
    out = tmp_path / "result.json"
    # The choices' measures as tests/link_budget_resume.sh injects them: an endless probe, an
    # instant one, in turn.
    assert succeeded(torchrun(4, "dist_link_budget.py", out, timeout=900,
                              env=dict(FLEXDEMO_INJECT_LINK="1e9,0,1e9,0,1e9,0")))
    result = json.loads(out.read_text())
    print(json.dumps(result, indent=1))
    assert [c["step"] for c in result["choices"]] == [4, 9, 14, 19, 24, 29]
    assert [c["step"] for c in result["resumed_choices"]["5"]] == [9, 14, 19, 24, 29]
    assert [c["step"] for c in result["resumed_choices"]["14"]] == [19, 24, 29]
