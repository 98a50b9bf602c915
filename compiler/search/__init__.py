"""The search: where the compiler's decisions are made, and nowhere else.

    egraph.py, rules.py, passes.py  an egglog e-graph that rewrites the graph into a cheaper
                                    equivalent one (the rules, and the Python passes around it)
    extract.py                      the search as the pipeline runs it: the e-graph, then
                                    extraction by measurement among verified candidates
    measure.py                      the helper process that runs candidates (a crash or a hang
                                    rejects the candidate, not the compile), timing in turns
    cuda_schedules.py               the CUDA schedules raced by device time on a GPU
"""

from compiler.search.egraph import SearchBudget, optimize

__all__ = ["SearchBudget", "optimize"]
