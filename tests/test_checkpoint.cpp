// The safetensors parser on hostile input (one process): what the fuzzer found stays fixed. The
// rule that carries a second moment across a resume (flexdemo/elastic.h), by its cases.
#include "flexdemo/elastic.h"
#include "flexdemo/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>
#include <string>

using namespace flexdemo;

namespace {

// A safetensors file whose JSON header is `header`, followed by `data_bytes` zero bytes.
std::string file_with_header(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  for (int b = 0; b < 8; ++b) out[b] = char(uint64_t(header.size()) >> (8 * b));
  return out + header + std::string(data_bytes, '\0');
}

void expect_rejected(const std::string& header, size_t data_bytes, const std::string& why) {
  const std::string f = file_with_header(header, data_bytes);
  try {
    train::parse_safetensors(reinterpret_cast<const uint8_t*>(f.data()), f.size(), "t");
    ADD_FAILURE() << "accepted " << header;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Safetensors, RejectsHostileHeadersBeforeAllocating) {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string f = file_with_header(ok, 8);
  EXPECT_EQ(
      train::parse_safetensors(reinterpret_cast<const uint8_t*>(f.data()), f.size(), "t").size(),
      1u);
  // Found by fuzz_checkpoint: a float where an integer belongs was undefined behaviour.
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,1.1e118]}})", 8,
                  "non-integer");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8, "non-integer");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[4000000000,4000000000],"data_offsets":[0,8]}})",
                  8, "impossible shape");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8,
                  "impossible shape");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", 8,
                  "negative offset");
  expect_rejected(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", 8,
                  "inconsistent byte range");
  expect_rejected(R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", 8, "dtype");
  expect_rejected(R"([1,2,3])", 0, "not a JSON object");
  expect_rejected(R"({"a":3})", 0, "corrupt safetensors header");
  expect_rejected(R"({"a":{"dtype":"F32")", 0, "corrupt safetensors header");
}

TEST(Safetensors, NamesFromTheHeaderAlone) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("flexdemo-names-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "state.safetensors").string();
  train::write_safetensors(path, {{"grad_sq.0", at::ones({3})}, {"residual.0", at::zeros({2, 2})}},
                           {{"written_by", "a test"}});
  const std::vector<std::string> names = train::safetensors_names(path);
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()),
            (std::set<std::string>{"grad_sq.0", "residual.0"}));  // not __metadata__
  // What is not a whole header is refused, each for its reason.
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const auto refused = [&](const std::string& bytes) -> std::string {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
    try {
      train::safetensors_names(path);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "accepted";
  };
  const auto says = [](const std::string& message, const std::string& why) {
    return message.find(why) != std::string::npos;
  };
  EXPECT_PRED2(says, refused("1234"), "shorter than its 8-byte header length");
  EXPECT_PRED2(says, refused(file_with_header(ok, 8).substr(0, 20)), "header longer than the file");
  EXPECT_PRED2(says, refused(std::string(8, '\xff') + "{}"), "header longer than the file");
  EXPECT_PRED2(says, refused(file_with_header("[1,2]", 0)), "not a JSON object");
  EXPECT_PRED2(says, refused(file_with_header("{\"a\":", 0)), "corrupt safetensors header");
  std::filesystem::remove_all(dir);
}

TEST(ResumedSecondMoment, KeepsTheCheckpointsKindUnderAutoAndRefusesAnother) {
  using optim::SecondMoment;
  // What a checkpoint's state names hold (the trainer's, and Python's per-replica keys).
  const auto own = optim::saved_second_moment({"residual.0", "grad_sq.0", "grad_sq.1"});
  EXPECT_EQ(own.kind, SecondMoment::Own);
  EXPECT_FALSE(own.summed_apart);
  EXPECT_EQ(optim::saved_second_moment({"grad_sq.replica1.shard0"}).kind, SecondMoment::Own);
  const auto shared = optim::saved_second_moment({"moment_rows.0", "moment_cols.0"});
  EXPECT_EQ(shared.kind, SecondMoment::Shared);
  EXPECT_FALSE(shared.summed_apart);
  const auto apart = optim::saved_second_moment({"moment_cols.0", "moment_own.0"});
  EXPECT_TRUE(apart.summed_apart);
  EXPECT_EQ(optim::saved_second_moment({"residual.0"}).kind, SecondMoment::Auto);  // none
  EXPECT_EQ(optim::saved_second_moment({"grad_sq.0", "moment_cols.0"}).kind, SecondMoment::Auto);
  EXPECT_EQ(optim::second_moment_of("moment_colsx.0"), SecondMoment::Auto);  // whole names only

  // The default step (auto: own below 4 replicas, shared from 4).
  const optim::OptimizerOptions step = optim::preset(optim::Preset::FlexDemo);
  ASSERT_TRUE(step.precondition);
  ASSERT_EQ(step.second_moment, SecondMoment::Auto);
  // Where auto chooses the saved kind, the options stand.
  EXPECT_EQ(optim::resumed_second_moment(step, 2, own).second_moment, SecondMoment::Auto);
  EXPECT_EQ(optim::resumed_second_moment(step, 4, shared).second_moment, SecondMoment::Auto);
  // Across auto's choice the saved kind is kept; each replica's own with the defaults of the
  // interval and encoding it does not use (here given for the shared one auto would take).
  optim::OptimizerOptions given = step;
  given.second_moment_every = 3;
  given.second_moment_values = optim::StatisticsEncoding::Log8;
  const optim::OptimizerOptions up = optim::resumed_second_moment(given, 4, own);
  EXPECT_EQ(up.second_moment, SecondMoment::Own);
  EXPECT_EQ(up.second_moment_every, optim::OptimizerOptions().second_moment_every);
  EXPECT_EQ(up.second_moment_values, optim::OptimizerOptions().second_moment_values);
  EXPECT_NO_THROW(up.validate());
  const optim::OptimizerOptions down = optim::resumed_second_moment(step, 2, shared);
  EXPECT_EQ(down.second_moment, SecondMoment::Shared);
  EXPECT_EQ(down.second_moment_every, 1);
  // Another kind asked for, or a shared one summed at another interval: refused in one line
  // naming the option to pass.
  const auto refusal = [](const optim::OptimizerOptions& o, int64_t replicas,
                          const optim::SavedSecondMoment& saved) -> std::string {
    try {
      optim::resumed_second_moment(o, replicas, saved);
    } catch (const optim::OptionsError& e) {
      return e.spelled([](const std::string& name) { return "--" + name; });
    }
    return "accepted";
  };
  optim::OptimizerOptions asked = step;
  asked.second_moment = SecondMoment::Shared;
  EXPECT_EQ(refusal(asked, 4, own),
            "the checkpoint holds the own second moment, this run's is shared (4 replicas): pass "
            "--second_moment own or auto to keep the checkpoint's");
  EXPECT_EQ(optim::resumed_second_moment(asked, 4, shared).second_moment, SecondMoment::Shared);
  asked.second_moment_every = 2;
  const std::string interval = refusal(asked, 4, shared);
  EXPECT_NE(interval.find("summed every step, this run's --second_moment_every is 2"),
            std::string::npos)
      << interval;
  EXPECT_EQ(optim::resumed_second_moment(asked, 4, apart).second_moment_every, 2);
  given = step;
  given.second_moment_every = 2;  // auto at 2 replicas keeps a shared one summed every step
  EXPECT_NE(refusal(given, 2, shared).find("summed every step"), std::string::npos);
  // A step without the preconditioner has no second moment to keep.
  optim::OptimizerOptions sign = optim::preset(optim::Preset::DeMo);
  ASSERT_FALSE(sign.precondition);
  EXPECT_EQ(optim::resumed_second_moment(sign, 4, own).second_moment, sign.second_moment);
}
