"""The compile pipeline's tuning constants, in one place: which candidates a compile builds, the
search's budget, the sizes and repeats candidates are verified and timed at, and when one is
dropped or chosen. Each says why it has its value. (The helper process's timeouts and a timing's
burst stay beside the helper, in compiler/search/measure.py.)
"""

from __future__ import annotations

from compiler.search.egraph import SearchBudget

# the programs a cpu compile builds, verifies and times: generated C whose products' schedules
# the schedule search chose kernel by kernel (compiler/search/cpu_schedules.py), the loop nests
# alone, and the NumPy lowering
CANDIDATES = ("native-searched", "native-loops", "numpy")
# every candidate the pipeline can build: also generated C with every product in one schedule
# (OpenBLAS; a convolution's windows in place where A is small; every convolution's product
# generated; every product generated), what compiles raced whole before the search, kept for
# tests, benchmarks and a compile_candidates setting that pins one
KNOWN_CANDIDATES = ("native-searched", "native-blas", "native-mixed", "native-panels", "native-tiled", "native-loops", "numpy")
# whether compiles run the search before lowering (compile_graph's `search` overrides), and its
# budget: the benchmark models (MiniLM-shaped BERT, GPT-2-style decoder, ResNet-style CNN,
# ResNet-50) take 0.1-0.6 s of it on a shared 2-core machine
SEARCH = True
SEARCH_BUDGET = SearchBudget(max_seconds=10.0)
# the schedule search's budget per model (seconds of rounds after the default one, shared by the
# program's forms) and the seed that orders each kernel's alternatives after its default
SCHEDULE_SEARCH_SECONDS = 30.0
SCHEDULE_SEARCH_SEED = 0
# how many times the CPU's schedule search measures every round, in turn (each kernel keeps its
# least time: a slow spell of the shared machine during one round must not decide its schedules)
SCHEDULE_MEASURE_PASSES = 3
# every symbol's size in the verification case (each symbol its own: this one, the next, ...)
VERIFY_SYMBOL_SIZE = 3
# candidates are timed with every symbol at the small size, then at the large one (a full batch)
# when the model allows it, several candidates are close and a run there is quick
MEASURE_SYMBOL_SIZE = 8
MEASURE_LARGE_SYMBOL_SIZE = 32
# and at a request's size: the batch symbol 1, every other (a sequence) this long, within the
# model's limits; every symbol at 8 is a batch of 8 sequences of 8 tokens, which no request is
MEASURE_REQUEST_SEQUENCE = 128
# per size: a warm-up run, then rounds (each candidate once) until each has the minimum and the
# budget (per candidate) has passed, or the maximum
MEASURE_MIN_REPEATS = 3
MEASURE_REPEATS = 7
MEASURE_BUDGET_S = 0.75
# a candidate this many times slower than the best is timed no more (after two runs) and is out
# of the race once the small size is timed
FAR_BEHIND = 4.0
# the large size is skipped when a run there would take longer than this (scaled from the small)
MAX_LARGE_RUN_S = 0.25
# the NumPy lowering is chosen over generated C only when it is this many times faster
NUMPY_MARGIN = 1.25
# a loop-nest candidate doing more multiply-adds than this at the measuring size is not timed:
# it would lose to the library call by orders of magnitude and take seconds to find out
MAX_LOOP_FLOPS = 5e7

__all__ = [
    "CANDIDATES",
    "FAR_BEHIND",
    "KNOWN_CANDIDATES",
    "MAX_LARGE_RUN_S",
    "MAX_LOOP_FLOPS",
    "MEASURE_BUDGET_S",
    "MEASURE_LARGE_SYMBOL_SIZE",
    "MEASURE_MIN_REPEATS",
    "MEASURE_REPEATS",
    "MEASURE_REQUEST_SEQUENCE",
    "MEASURE_SYMBOL_SIZE",
    "NUMPY_MARGIN",
    "SCHEDULE_MEASURE_PASSES",
    "SCHEDULE_SEARCH_SECONDS",
    "SCHEDULE_SEARCH_SEED",
    "SEARCH",
    "SEARCH_BUDGET",
    "VERIFY_SYMBOL_SIZE",
]
