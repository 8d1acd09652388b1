"""Phase 1 only: Engine(deterministic=True) through the prototypes, before the mode is in the engine."""
import llama3_generate as L
import h64_proto

if "deterministic" not in L.Engine.__init__.__code__.co_varnames:
    Base = L.Engine

    class Engine(Base):
        def __init__(self, model, tok, *a, deterministic=False, **kw):
            if deterministic:
                kw["fused"] = False
            super().__init__(model, tok, *a, **kw)
            if deterministic:
                h64_proto.enable(self)
    L.Engine = Engine
