"""thinkserve.kvtransfer: moving KV between engine instances and the per-node CPU KV store.

Modules (see docs/kvtransfer.md):
    page_set    PageSet / PageSetHeader: a request's blocks + typed metadata; msgpack + raw frames
    transport   Transport / PageSink interfaces, TransferConfig, typed errors
    conversation ZmqTransport: the offer / accept / done conversation (pyzmq) every transport speaks
    tcp         TcpTransport (the bytes over plain TCP connections; every machine, across nodes)
    shm         ShmTransport (same node: the receiver maps the sender's shared segment, or reads
                its memory with process_vm_readv, or the bytes go through a shared-memory ring)
    shared_buffers  memfd segments a same-node receiver or the store can map; cma: process_vm_readv
    collective  PairGroupTransport (torch.distributed pair groups: gloo on CPU, NCCL on GPU)
    block_pool  BlockPool: a plain block pool that receives page sets, the engine-less receiver of
                bench_kvtransfer and the transport tests (serving receives through flows.EngineSink)
    store       KVStore (capacity, LRU, pins, stats), StoreServer / StoreClient (zmq)
    swap        StoreSwapSpace: the store as an engine's preemption swap space (workers/swap_space.py)
    flows       export_for + send_share (handoff, fan-out, migration), EngineSink + receive, send_exported,
                swap_out / swap_in, store_prefix / load_prefix
    telemetry   TransferRecord, TelemetryLog / TransferTotals, TELEMETRY (an instance's KV transfer totals)
"""
