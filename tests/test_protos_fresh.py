"""The committed specdec/v1/*_pb2*.py must match what the .proto files generate today."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_generated_protobuf_code_is_fresh():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_protos.py"), "--check"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, f"stale generated code; run `python scripts/gen_protos.py`\n{proc.stdout}{proc.stderr}"
