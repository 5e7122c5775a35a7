// Uses flexdemo's DeMo optimizer on plain LibTorch parameters: every MPI rank is a replica that
// fits the same linear map from its own samples, exchanging only DeMo's compressed momentum.
// Run: mpirun -np 2 ./demo_regression   (exits non-zero unless the loss falls 10x)
#include <flexdemo/comm.h>
#include <flexdemo/optim.h>
#include <flexdemo/runtime.h>
#include <torch/torch.h>

#include <cstdio>

int main(int argc, char** argv) {
  flexdemo::comm::MpiRuntime mpi(&argc, &argv);
  auto world = mpi.world();
  flexdemo::set_num_threads(1);

  torch::manual_seed(0);  // the same target and starting point on every replica
  const torch::Tensor target = torch::randn({16, 64});
  torch::Tensor weight = torch::zeros({16, 64}, torch::requires_grad());

  flexdemo::optim::OptimizerOptions options;
  options.lr = 0.02;
  options.topk = 16;
  options.chunk = 16;
  options.values = flexdemo::compress::ValueEncoding::Bf16;
  flexdemo::optim::Optimizer demo({weight}, options, world);

  torch::manual_seed(1 + world->rank());  // but each replica sees its own data
  double first = 0, last = 0;
  for (int step = 0; step < 400; ++step) {
    const torch::Tensor x = torch::randn({32, 64});
    const torch::Tensor loss = (torch::mm(x, (weight - target).t())).pow(2).mean();
    demo.zero_grad();
    loss.backward();
    demo.step();
    // The loss each replica reports differs (own data); average it for the log.
    torch::Tensor mean = loss.detach().reshape({1}).clone();
    world->all_reduce(mean, flexdemo::comm::ReduceOp::Avg);
    if (step == 0) first = mean.item<double>();
    last = mean.item<double>();
    if (world->rank() == 0 && step % 100 == 0) std::printf("step %3d  loss %.4f\n", step, last);
  }
  const auto traffic = demo.traffic();
  if (world->rank() == 0) {
    std::printf("loss %.4f -> %.4f; each step sent %llu bytes for %lld parameters\n", first, last,
                static_cast<unsigned long long>(traffic.wire_bytes),
                static_cast<long long>(traffic.params));
  }
  return last < first / 10 ? 0 : 1;
}
