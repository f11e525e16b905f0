"""Ascend random-number kernels (SPEC §9): one module per op (``fill_rand``, ``fill_randn``)
over the shared draw kernel (:mod:`.draw`) and Philox rounds (:mod:`.philox`)."""

from tileplug.backend_ascend.random import fill_rand, fill_randn

KERNELS = {
    "fill_rand": fill_rand.KERNEL,
    "fill_randn": fill_randn.KERNEL,
}
