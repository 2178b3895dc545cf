"""``xtl._quiet``: third-party load noise is silenced in xtl processes, and shown with ``XTL_DEBUG=1``."""

from __future__ import annotations

import os
import re
import subprocess
import sys

IMPORTS = "import torchao.float8, torchao.quantization"


def _stderr(code: str, debug: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XTL_DEBUG"}
    if debug:
        env["XTL_DEBUG"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return re.sub(r"\d{2}:\d{2}:\d{2}\.\d+ \d+", "<time pid>", proc.stderr)  # glog-style prefixes


class TestThirdPartyNoise:
    def test_torchao_loads_quietly_in_an_xtl_process_and_loudly_with_xtl_debug(self):
        plain = _stderr(IMPORTS, debug=False)
        assert _stderr(f"import xtl; {IMPORTS}", debug=False) == ""
        assert _stderr(f"import xtl; {IMPORTS}", debug=True) == plain
        # where torchao's optional extensions do not load (this CPU machine), the noise silenced is real
        assert not plain or "Failed to load" in plain or "register_constant" in plain, plain
