"""A Canzona engine's checkpoints, DeepSpeed's side (the format, the reader and the atomic tag
are canzona_ds/ckpt/, which imports no DeepSpeed).

    hooks.py         engine.save_checkpoint / load_checkpoint: DeepSpeed writes its files, then
                     the index, the manifest and `latest`; a load is verified, then routed
    emit.py          save: every placement describes the chunks it holds (-> canzona_index.json);
                     the layout fingerprints; the ``canzona_checkpoint`` section
    route.py         load: the one comparison (DeepSpeed's stock load, or the index loop), the
                     loop's checks and refusals, the engine state and param groups restored
    fill.py          the loop's fills (stage 0, ZeRO 1/2, ZeRO 3) and the TP-layout permutations
    param_groups.py  the param groups' hyper-parameters, recorded at save and written back at load
    safe.py          every read of a tag unpickles data only (ckpt/safe_load.py), DeepSpeed's too

A save:  registry.save_checkpoint -> hooks.save_checkpoint -> DeepSpeed's save -> emit.gather_index
         -> ckpt/index.Index.dumps -> ckpt/tag.write_manifest -> `latest`
A load:  registry.load_checkpoint -> hooks.load_checkpoint -> ckpt/tag.load (verify) ->
         route.index_route -> DeepSpeed's load | route.load -> fill.* (ckpt/index.Reader) ->
         route.restore_param_groups
"""
