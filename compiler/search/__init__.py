"""The search compiler: rewrites a primitive-op graph into a cheaper equivalent one.

Its first stage is an egglog e-graph that removes work (compiler/search/egraph.py), driven by
the rules in compiler/search/rules.py. compiler/search/measure.py runs candidate programs in a
helper process (a crash or a hang rejects the candidate, not the compile) and times them in turns.
"""

from compiler.search.egraph import SearchBudget, optimize

__all__ = ["SearchBudget", "optimize"]
