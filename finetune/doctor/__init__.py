"""`finetune doctor`: the supported range of each dependency against what is installed (`finetune.config.versions`,
which every command checks first), the machine (`machine`), and a short self-test on its device (`selftest`),
printed by `report`."""
