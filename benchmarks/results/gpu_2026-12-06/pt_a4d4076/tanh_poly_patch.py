"""Experiment only (not committed): replace helpers.tmpl's tanh.approx with an odd polynomial."""
import sys
from pathlib import Path

COEF = {"5": [0.9997851855238082, -0.32629657338133233, 0.09735522216779706],
        "7": [0.999918520450592, -0.33065420389175415, 0.11889733374118805, -0.02662953920662403],
        "9": [0.9998371005058289, -0.3295486867427826, 0.1183418557047844, -0.030935049057006836,
              0.0038410432171076536]}
R = {"5": 0.75, "7": 1.0, "9": 1.5}
which, clamp = sys.argv[1], sys.argv[2] == "clamp"
path = Path("flexfa/codegen/templates/helpers.tmpl")
text = path.read_text()
old = ('    return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,\n'
       '                                     is_pure=True, pack=1)\n')
assert text.count(old) == 1
c = COEF[which]
body = ""
if clamp:
    body += f"    x = tl.minimum(tl.maximum(x, -{R[which]}), {R[which]})\n"
body += "    x2 = x * x\n"
body += f"    p = x2 * {c[-1]!r} + {c[-2]!r}\n"
for ci in c[-3::-1]:
    body += f"    p = p * x2 + {ci!r}\n"
body += "    return p * x\n"
path.write_text(text.replace(old, body))
print(body)
