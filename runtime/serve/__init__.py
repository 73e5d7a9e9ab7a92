"""Relay-race ranking service (docs/architecture.md §5): ranker replicas with a prefix KV cache, and a
router.

Modules: ``engine`` (relay inference on HSTU), ``cache`` (device LRU + DRAM expander), ``scheduler``
(batched compute loop), ``ranker`` / ``router`` (HTTP services), ``trigger`` (sequence-aware trigger),
``ring`` (consistent hashing with bounded load), ``placement`` / ``etcd_store`` (placement stores),
``local`` (router + ranker processes on one machine), ``loadgen`` (open-loop load), ``demo``.
Nothing is imported here, so ``grstack --help`` stays light.
"""
