"""The persistent Ray worker pool: the pool and its worker groups (`pool`, `group`), one
worker process (`worker`), a role served by a group (`proxy`), how a batch is split over
ranks (`dispatch`), where ranks run (`placement`), rollout replicas (`replica`), and the Ray
cluster under it (`cluster`, `node`)."""
