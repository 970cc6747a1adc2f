"""Which loads each instruction waits for: the scoreboard bits of sm_90 SASS (cuobjdump -sass).

    python dev/sass_waits.py KERNEL.sass [FUNCTION]

cuobjdump prints each instruction with its 128-bit encoding but not the scheduling control bits.
On Volta and later they are bits 105-127: stall cycles (4), yield (1), the scoreboard a variable-
latency instruction sets when its result is written (3 bits, 7 = none) and when its sources are
read (3), the mask of scoreboards the instruction waits for (6) and operand reuse (4). Printing the
loads, the MMAs and every instruction that waits shows, for example, that ptxas put all 40 loads of
the CUDA MMA MoE kernel on one scoreboard, so its first product waited for every byte
(docs/kernels-history.md). Works on the .sass files of dev/compile_sm90.py.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\* (0x[0-9a-f]+) \*/")
HIGH = re.compile(r"/\* (0x[0-9a-f]+) \*/")


def decode(sass: str, function: str | None) -> list[str]:
    if function:
        sass = sass.split(f"Function : {function}", 1)[1].split("Function : ", 1)[0]
    lines = sass.splitlines()
    out = []
    for i, line in enumerate(lines[:-1]):
        m = INSN.search(line)
        high = HIGH.search(lines[i + 1]) if m else None
        if not m or not high or INSN.search(lines[i + 1]):
            continue
        ctrl = int(high.group(1), 16) >> 41
        write_sb, read_sb, wait = (ctrl >> 5) & 7, (ctrl >> 8) & 7, (ctrl >> 11) & 0x3F
        text = m.group(2).strip()
        tags = []
        if write_sb != 7:
            tags.append(f"sets SB{write_sb}")
        if read_sb != 7:
            tags.append(f"reads-done SB{read_sb}")
        if wait:
            tags.append("waits " + ",".join(f"SB{b}" for b in range(6) if wait >> b & 1))
        if tags or any(op in text for op in ("LDG", "LDS", "MMA", "BAR")):
            out.append(f"{m.group(1)}  {text[:70]:<70} {' '.join(tags)}")
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print("\n".join(decode(Path(sys.argv[1]).read_text(), sys.argv[2] if len(sys.argv) > 2 else None)))
