// Tensor-parallel layers, run by every rank under `shardtrain launch` with the
// whole world as one tensor-parallel group (world 2 and 4):
//
//   - the vocabulary-parallel cross-entropy and the vocabulary gather against
//     the fp64 definition computed here (loss and every rank's columns of the
//     gradient), with vocabularies that do not divide by the group, rows
//     whose target is ignored, and zero and one rows;
//   - the collectives one Llama decoder layer issues in forward, counted the
//     way PyTorch's tensor-parallel tests count them: 2 all-reduces, or with
//     sequence parallelism 2 all-gathers and 2 reduce-scatters; and nothing
//     the count misses (the group's sequence number moves by the same);
//   - the mesh: every dimension's group holds the ranks its layout says.
//
// The training parity of whole models against the independent reference is
// in tests/models/llama_parity.py (the tp cases).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/tensor_parallel.h"
#include "shardtrain/comm/communicator.h"
#include "shardtrain/comm/mesh.h"
#include "shardtrain/models/family.h"
#include "shardtrain/models/llama.h"
#include "shardtrain/parallel/tensor_parallel.h"
#include "world.h"

using namespace shardtrain;

namespace {

std::shared_ptr<comm::Communicator>& g_world = ::shardtrain::testing::world_ptr();

// A module standing for a model root, registered with a group over the world.
struct Root : torch::nn::Module {};

std::shared_ptr<models::detail::TensorParallelGroup> world_group(int64_t vocab, bool loss_parallel) {
  auto g = std::make_shared<models::detail::TensorParallelGroup>();
  g->comm = g_world;
  g->loss_parallel = loss_parallel;
  g->vocab_size = vocab;
  const comm::ShardRange s = comm::shard_range(vocab, g_world->size(), g_world->rank());
  g->vocab_start = s.offset;
  g->vocab_local = s.count;
  return g;
}

// The definition in fp64: sum over kept rows of logsumexp(row) - row[target],
// and its gradient softmax(row) - onehot(target) (zero for ignored rows).
std::pair<double, at::Tensor> definition(const at::Tensor& logits, const at::Tensor& target) {
  const at::Tensor x = logits.to(at::kDouble);
  at::Tensor grad = at::zeros_like(x);
  double loss = 0.0;
  for (int64_t i = 0; i < x.size(0); ++i) {
    const int64_t t = target[i].item<int64_t>();
    if (t == -100) continue;
    const at::Tensor row = x[i];
    const double m = row.max().item<double>();
    const double lse = m + std::log((row - m).exp().sum().item<double>());
    loss += lse - row[t].item<double>();
    grad[i].copy_((row - lse).exp());
    grad[i][t].sub_(1.0);
  }
  return {loss, grad};
}

class VocabParallelLoss : public ::testing::TestWithParam<std::tuple<int64_t, int64_t, bool>> {};

TEST_P(VocabParallelLoss, MatchesTheDefinition) {
  const auto [vocab, rows, loss_parallel] = GetParam();
  auto gen = at::detail::createCPUGenerator(11);
  const at::Tensor logits = at::randn({rows, vocab}, c10::optional<at::Generator>(gen)) * 3.0;
  at::Tensor target = at::randint(vocab, {rows}, c10::optional<at::Generator>(gen), at::kLong);
  if (rows > 1) target[1].fill_(-100);  // an ignored row
  const auto [want, want_grad] = definition(logits, target);

  Root root;
  auto group = world_group(vocab, loss_parallel);
  models::detail::set_tensor_parallel(root, group);
  const at::Tensor mine =
      logits.narrow(1, group->vocab_start, group->vocab_local).clone().set_requires_grad(true);
  // As the model returns them: the whole vocabulary unless the loss is parallel.
  const at::Tensor out = models::detail::vocab_logits(root, mine);
  ASSERT_EQ(out.size(1), loss_parallel ? group->vocab_local : vocab);
  const at::Tensor loss = models::detail::lm_cross_entropy_sum(root, out, target, -100);
  EXPECT_NEAR(loss.item<double>(), want, 1e-5 * (1.0 + std::abs(want)));
  if (rows == 0) return;  // nothing to differentiate
  loss.backward();
  const at::Tensor expected = want_grad.narrow(1, group->vocab_start, group->vocab_local);
  ASSERT_TRUE(mine.grad().defined());
  EXPECT_LE((mine.grad().to(at::kDouble) - expected).abs().max().item<double>(), 1e-6)
      << "rank " << g_world->rank() << "'s columns of the gradient";
}

// Vocabularies of one class per rank, not divisible by 2 or 4 (7, 13), and
// divisible (16); 0, 1 and 6 rows.
INSTANTIATE_TEST_SUITE_P(Sizes, VocabParallelLoss,
                         ::testing::Combine(::testing::Values(4, 7, 13, 16), ::testing::Values(0, 1, 6),
                                            ::testing::Bool()));

TEST(VocabParallelLoss, RefusesTargetsOutsideTheVocabulary) {
  Root root;
  models::detail::set_tensor_parallel(root, world_group(8, true));
  const auto group = models::detail::tensor_parallel_of(root);
  const at::Tensor logits = at::zeros({2, group->vocab_local});
  EXPECT_THROW(models::detail::lm_cross_entropy_sum(root, logits, at::tensor({0L, 8L}), -100), InvalidArgument);
}

// ---- one decoder layer's collectives ------------------------------------------------------------

models::LlamaConfig tiny_llama() {
  models::LlamaConfig c;
  c.vocab_size = 32;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 1;
  c.num_heads = 4;
  c.num_kv_heads = 4;
  c.head_dim = 8;
  c.block_size = 8;
  c.max_positions = 8;
  return c;
}

struct Counts {
  int64_t all_reduces, all_gathers, reduce_scatters;
  uint64_t sequence;
};
Counts counts(const models::detail::TensorParallelGroup& g) {
  return {g.all_reduces.load(), g.all_gathers.load(), g.reduce_scatters.load(), g_world->sequence_number()};
}

void expect_layer_collectives(bool sequence_parallel) {
  torch::manual_seed(3);
  const models::LlamaConfig c = tiny_llama();
  auto model = std::make_shared<models::LlamaImpl>(c);
  parallel::apply_tensor_parallel(*model, models::family_of(train::ModelType::Llama).tensor_parallel_plan(),
                                  g_world, parallel::TensorParallelOptions().sequence_parallel(sequence_parallel));
  auto block = model->model->layers->ptr<models::llama::BlockImpl>(0);
  const auto* g = models::detail::tensor_parallel_of(*model);
  ASSERT_NE(g, nullptr);
  const int tp = g_world->size();
  const int64_t b = 2, t = c.block_size;
  const at::Tensor x = at::randn({b, sequence_parallel ? t / tp : t, c.hidden_size});
  const models::RotaryTables rot = models::rotary_tables(c);
  const at::Tensor cos = rot.cos.narrow(0, 0, t).unsqueeze(0).expand({b, t, -1});
  const at::Tensor sin = rot.sin.narrow(0, 0, t).unsqueeze(0).expand({b, t, -1});
  const Counts before = counts(*g);
  torch::NoGradGuard no_grad;
  const at::Tensor y = block->forward(x, cos, sin, {});
  const Counts after = counts(*g);
  EXPECT_EQ(y.sizes(), x.sizes());
  const int64_t ar = after.all_reduces - before.all_reduces, ag = after.all_gathers - before.all_gathers,
                rs = after.reduce_scatters - before.reduce_scatters;
  if (sequence_parallel) {
    EXPECT_EQ(ar, 0);
    EXPECT_EQ(ag, 2);
    EXPECT_EQ(rs, 2);
  } else {
    EXPECT_EQ(ar, 2);
    EXPECT_EQ(ag, 0);
    EXPECT_EQ(rs, 0);
  }
  // Nothing the layers issued on the group escaped the count.
  EXPECT_EQ(static_cast<int64_t>(after.sequence - before.sequence), ar + ag + rs);
}

TEST(TensorParallelLayer, ForwardIssuesTwoAllReduces) { expect_layer_collectives(false); }
TEST(TensorParallelLayer, SequenceParallelForwardGathersAndScattersTwice) { expect_layer_collectives(true); }

// ---- the mesh ------------------------------------------------------------------------------------

TEST(DeviceMesh, GroupsFollowTheLayout) {
  const int n = g_world->size();  // 2 or 4
  // tp 2 innermost; the rest data-parallel, as hybrid shards over n/2 hosts of one rank each.
  const comm::MeshShape shape = comm::mesh_shape_for(n, n, 2, 1, false);
  EXPECT_EQ(shape.tp(), 2);
  EXPECT_EQ(shape.dp_shard(), n / 2);
  const comm::DeviceMesh mesh = comm::DeviceMesh::create(g_world, shape);
  const int r = g_world->rank();
  EXPECT_EQ(mesh.tp()->global_ranks(), (std::vector<int>{r - r % 2, r - r % 2 + 1}));
  EXPECT_EQ(mesh.dp()->size(), n / 2);
  EXPECT_EQ(mesh.dp_shard()->size(), n / 2);
  EXPECT_EQ(mesh.dp_replicate()->size(), 1);
  if (n == 4) {
    EXPECT_EQ(mesh.dp()->global_ranks(), (std::vector<int>{r % 2, r % 2 + 2}));  // hybrid: 2 hosts of 2 data-parallel ranks -> dp_shard 1 per host after tp 2
    const comm::DeviceMesh hybrid = comm::DeviceMesh::create(g_world, comm::mesh_shape_for(4, 2, 1, 1, true));
    EXPECT_EQ(hybrid.dp_shard()->global_ranks(), (std::vector<int>{r - r % 2, r - r % 2 + 1}));
    EXPECT_EQ(hybrid.dp_replicate()->global_ranks(), (std::vector<int>{r % 2, r % 2 + 2}));
  }
}

TEST(DeviceMesh, RefusesATensorParallelGroupAcrossHosts) {
  EXPECT_THROW(comm::mesh_shape_for(4, 2, 4, 1, false), ConfigError);  // 4 over hosts of 2
  EXPECT_THROW(comm::mesh_shape_for(6, 3, 2, 1, false), ConfigError);  // 2 does not divide 3 per host
  EXPECT_NO_THROW(comm::mesh_shape_for(4, 2, 2, 1, false));
}

}  // namespace
