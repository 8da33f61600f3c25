"""py-spy raw (collapsed) stacks: per thread, samples by the innermost rpcompile/torch frame line."""
import collections, sys
by = collections.defaultdict(collections.Counter)
tot = collections.Counter()
for line in open(sys.argv[1]):
    line = line.rstrip()
    if not line:
        continue
    stack, n = line.rsplit(" ", 1)
    n = int(n)
    frames = stack.split(";")
    thread = frames[0]
    tot[thread] += n
    inner = [f for f in frames[1:] if "rpcompile" in f]
    key = " < ".join(reversed(frames[-2:])) + ("  @ " + inner[-1] if inner else "")
    by[thread][key] += n
print(sys.argv[1])
for thread, c in sorted(by.items(), key=lambda x: -tot[x[0]]):
    print(f"== {thread}: {tot[thread]} samples")
    for k, n in c.most_common(8):
        print(f"   {n:5d} {k[:300]}")
