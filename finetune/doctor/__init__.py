"""`finetune doctor` and the version check every command makes first: the supported range of each dependency
against what is installed (`versions`), the machine (`machine`), and a short self-test on its device (`selftest`),
printed by `report`."""
