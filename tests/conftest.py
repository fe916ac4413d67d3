"""Session-wide test settings.

One intra-op thread for the whole session: the tensors under test are tiny, and on a CI machine
with two busy cores (or with two test workers) torch's thread pool spins instead of helping. The
forked gloo ranks of ``mp_utils.run_ranks`` set the same.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_intra_op_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
