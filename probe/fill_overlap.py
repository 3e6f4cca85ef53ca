"""One-off (session 36): xgrammar's mask fill on a worker thread beside 1.3 ms of Python, against one
after the other.  python probe/fill_overlap.py TOKENIZER_DIR"""
import threading, time, json, sys, statistics
from concurrent.futures import ThreadPoolExecutor
import xgrammar as xgr, torch
from transformers import AutoTokenizer
from specserve.runtime.grammar import fill_masks, BatchFill
tok = AutoTokenizer.from_pretrained(sys.argv[1])
info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152)
comp = xgr.GrammarCompiler(info)
SCHEMA = {"type": "object", "properties": {"title": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}, "minItems": 1}}, "required": ["title", "notes"]}
cg = comp.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
text = '{"title": "Some notes on the way to go home", "notes": ["one thing", "another thing to say about it'
ids = tok.encode(text, add_special_tokens=False)
ms = []
for i in range(64):
    m = xgr.GrammarMatcher(cg); cut = 8 + i % (len(ids) - 12)
    for t in ids[:cut]: assert m.accept_token(t)
    ms.append((m, ids[cut:cut + 3]))
bm = torch.full((256, 1536), -1, dtype=torch.int32)
bf = BatchFill(1)
spans = [(m, 4 * i, d) for i, (m, d) in enumerate(ms)]
def process_like(n=18000):  # pure Python work, ~1 ms
    x = 0
    for i in range(n): x += len(str(i))
    return x
def t(f, reps=200):
    out = []
    for _ in range(reps):
        s = time.perf_counter(); f(); out.append(time.perf_counter() - s)
    return statistics.median(out) * 1e3
fill = lambda: fill_masks(bm, spans, bf)
print("fill %.3f ms, process-like %.3f ms, serial %.3f ms" % (t(fill), t(process_like), t(lambda: (fill(), process_like()))))
ex = ThreadPoolExecutor(1)
def par():
    f = ex.submit(fill); process_like(); f.result()
for si in (0.005, 0.001, 0.0002, 0.00005):
    sys.setswitchinterval(si)
    print("switch %.0f us: overlapped %.3f ms" % (si * 1e6, t(par)))
import cProfile, pstats
sys.setswitchinterval(0.005)
pr = cProfile.Profile(); pr.enable()
for _ in range(200): fill()
pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(8)
