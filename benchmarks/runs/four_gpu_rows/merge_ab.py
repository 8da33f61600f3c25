"""Merge an ab.sh pair into one run file in benchmarks/runs, the reference's systems renamed
<system>@<rev> (as benchmarks.bar reads the exact-mode rows). From the repository root:

    python benchmarks/runs/four_gpu_rows/merge_ab.py REF.json TREE.json REF_REV TREE_REV
"""
import json, sys
sys.path.insert(0, '.')
from benchmarks import run_files
ref_path, tree_path, rev, tree_rev = sys.argv[1:5]
ref = json.load(open(ref_path)); tree = json.load(open(tree_path))
ref = ref[0] if isinstance(ref, list) else ref
tree = tree[0] if isinstance(tree, list) else tree
run = tree
trees = {}
for r in tree['results']:
    trees[r['system']] = tree_rev
for r in ref['results']:
    r = dict(r); r['system'] = f"{r['system']}@{rev}"; trees[r['system']] = rev
    run['results'].append(r)
run['meta']['trees'] = trees
run['meta']['reference_command'] = ref['meta'].get('command')
run['meta']['reference_started_utc'] = ref['meta'].get('started_utc')
print(run_files.write_run(run_files.DEFAULT_DIR, run))
