import multiprocessing as mp, os, sys, tempfile, time
sys.path.insert(0, os.getcwd())

def consumer(path, q):
    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge._ffi import ffi, lib
    from arrow_ipc_bridge.memory import cuda_regions
    from arrow_ipc_bridge.metadata import Decoded
    s = aib.connect(path, timeout=30, pool_linger=0.0)
    while True:
        name = q.get()
        if name is None:
            break
        with s.get(name) as imp:
            imp.to_host()
        print("got", name, "new", s.new_message_gets, "remembered", s.remembered_gets, "table", lib.aib_regions_count(), flush=True)
    # diagnostics on the last remembered message
    msg = list(s._resolved.keys())[-1]
    keeper = lib.aib_owner_new(0)
    o = lib.aib_import_new(msg, len(msg), 0, 0, keeper)
    print("import_new ->", o != ffi.NULL, flush=True)
    d = Decoded(msg, 0)
    dev = d.device(); regs = d.regions(); d.close()
    print("device", dev.identity.hex(), "sync", dev.sync[:8].hex(), "regions", [(r.kind, r.flags, len(r.handle)) for r in regs], flush=True)
    print("remove device", lib.aib_regions_remove(lib.AIB_REGION_KEY_DEVICE, dev.identity, len(dev.identity)))
    print("remove event", lib.aib_regions_remove(lib.AIB_REGION_KEY_EVENT, dev.sync, len(dev.sync)))
    for r in regs:
        print("remove pool", lib.aib_regions_remove(lib.AIB_REGION_KEY_POOL, r.handle, len(r.handle)))
    print("kept keys", [k.hex()[:16] for k in cuda_regions.opener()._kept], [r.handle.hex()[:16] for r in regs])
    print(cuda_regions.cuda_stats(), flush=True)

if __name__ == "__main__":
    import cupy
    import arrow_ipc_bridge as aib
    from arrow_ipc_bridge.memory import cuda
    d = tempfile.mkdtemp()
    pub = aib.Publisher(os.path.join(d, "s"))
    alloc = cuda.cupy_allocator(0, slab_size=8 << 20)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=consumer, args=(str(pub.path), q))
    p.start()
    for i in range(6):
        with cupy.cuda.using_allocator(alloc):
            cols = {f"c{j}": cupy.full(5000, float(i), dtype=cupy.float32) for j in range(4)}
        pub.publish(f"s{i}", aib.from_cuda_arrays(cols))
        del cols
        q.put(f"s{i}")
        time.sleep(1.0)
        if i:
            pub.unpublish(f"s{i-1}")
    q.put(None)
    p.join(60)
    pub.close()
