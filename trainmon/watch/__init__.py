"""`trainmon watch`: the monitor daemon beside the job (design §2).

It follows every rank's output through the read layer (`trainmon.read`), never writes into rank
directories, and turns the ranks' output into one TensorBoard view (cross-rank min/median/max per tensor
and op), heatmaps, and live cross-rank alerts computed with nan-analyze's own ordering and attribution.

Modules: `follow` (one rank's progress), `aggregate` (cross-rank figures and tags), `history` (the
bounded window the heatmaps draw), `heatmap` (the pictures), `grid` (their layers and rank buckets),
`canvas` (one picture drawn with matplotlib), `alerts` (live attribution),
`events` (the TensorBoard file, resumable), `state` (the state file), `run_watcher` (one run),
`daemon` (the loop over a run or a root, signals), `spawn` (started from `TrainerMon`).
"""
