"""No tracked file keeps a merge's conflict markers (one landed in CHANGELOG.md once, unnoticed by every other test)."""
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(rb"^(<{7} |>{7} |={7}$)", re.M)


def test_no_tracked_text_file_holds_a_conflict_marker():
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    found = []
    for name in filter(None, names):
        path = ROOT / name.decode()
        if not path.is_file() or path.stat().st_size > 4 << 20:
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for m in MARKER.finditer(data):
            line = data.count(b"\n", 0, m.start()) + 1
            found.append(f"{name.decode()}:{line}")
    assert not found, f"conflict markers left by a merge: {found}"
