"""The search: where the compiler's decisions are made, and nowhere else.

    egraph.py, rules.py, passes.py  an egglog e-graph that rewrites the graph into a cheaper
                                    equivalent one (the rules, and the Python passes around it)
    extract.py                      the search as the pipeline runs it: the e-graph, then
                                    extraction by measurement among verified candidates
    measure.py                      the helper process that runs candidates (a crash or a hang
                                    rejects the candidate, not the compile), timing in turns
    kernel_rules.py                 egglog rules over the lowered kernels that find attention
                                    (online softmax) and a product's epilogue from primitives
    schedule.py                     the schedule e-graph: each kernel's term, the rules that add
                                    its alternatives (tiles, tensor cores, library calls, threads,
                                    rows per warp or block, windows in place), extraction by
                                    per-kernel measurement in rounds, the kernel cache
    cuda_schedules.py               that search on a GPU (CUDA events), attention fused or not
    cpu_schedules.py                that search on the CPU (the helper process): native-searched
"""

from compiler.search.egraph import SearchBudget, optimize

__all__ = ["SearchBudget", "optimize"]
