"""Code the tests share: data strategies, message crafting, child-process entry points, fixtures' parts.

Tests import it as ``from helpers import wire_craft`` or ``from helpers.session_rig import ...``:
pytest puts ``tests/`` on ``sys.path`` (the test files are not a package), processes started with
multiprocessing's "spawn" copy the parent's ``sys.path``, and subprocesses the tests start get
``tests/`` on ``PYTHONPATH`` (``session_rig.child_env``). ``fuzz_decoder`` and ``golden_cases`` are
also scripts, run by path (``python tests/helpers/fuzz_decoder.py``); they import only the package.

Modules:

* ``arrow_types`` -- Arrow type kinds, the tests' extension type and hypothesis strategies for types;
* ``arrow_values`` -- hypothesis strategies for arbitrary Arrow data (arrays, schemas, batches, tables);
* ``arrow_equality`` -- ``assert_arrays_equal``, the strict comparison of Arrow data;
* ``wire_craft`` -- an independent writer of bridge messages (docs/wire-format.md), for hostile input;
* ``golden_cases`` -- the deterministic messages checked into ``tests/golden/`` (and their writer);
* ``fuzz_decoder`` -- the mutation fuzzer of the decoder and content checks (run in a subprocess);
* ``cuda_helpers`` -- CUDA driver calls only the tests need;
* ``session_rig`` -- what the publisher/session tests share: leak snapshots, producer children, a fake
  publisher, sample data;
* ``session_children`` / ``gpu_children`` -- entry points of the processes those tests start.
"""
