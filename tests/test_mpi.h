// Shared by the MPI test files: the world communicator of this test process.
#pragma once
#include "flexdemo/comm.h"

std::shared_ptr<flexdemo::comm::Communicator> test_world();
