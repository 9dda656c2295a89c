// SOCA's loading path, without oops, eckit or MPI: load the two files of
// python -m toolkit.export torchscript RUN_DIR --out DIR/MODEL.pt --format soca into IceNet (icenet.h) as SOCA's
// BaseEmul.h constructor does, then run forward and jac one point at a time as IceEmul.h's predict (and MLJac.h)
// call them, and print what they return.
//
//   soca_icenet MODEL.pt INPUTS.csv --hidden-size H [--input-size 7] [--output-size 1]
//
// The sizes are BaseEmul's YAML ffnn.inputSize, ffnn.hiddenSize, ffnn.outputSize. INPUTS.csv: one point per line,
// the inputs in SOCA's order (tair, tsfc, sst, sss, hs, hi, sice; a first line that is not numeric is a header and
// is skipped). Output: the header aice,daice_dtair,...,daice_dsice (the Jacobian entry k is d aice / d input k, as
// IceEmul.h stores dcdtair = doutdx[0], ..., dcdsi = doutdx[6]), then one line per point: prediction.item<float>()
// and doutdx[k].item<float>(), printed with 9 significant digits (a float32 round trip). Errors: one line on stderr,
// exit 2.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "csv_inputs.h"
#include "icenet.h"

static const char* const kInputs[] = {"tair", "tsfc", "sst", "sss", "hs", "hi", "sice"};  // IceEmul.h prepData

static std::string number(float value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", static_cast<double>(value));
  return text;
}

static bool size_flag(const std::string& value, int& size) {
  char* end = nullptr;
  long parsed = std::strtol(value.c_str(), &end, 10);
  if (*end != '\0' || parsed < 1) return false;
  size = static_cast<int>(parsed);
  return true;
}

int main(int argc, char** argv) {
  const std::string usage =
      "usage: soca_icenet MODEL.pt INPUTS.csv --hidden-size H [--input-size 7] [--output-size 1]";
  std::vector<std::string> positional;
  int inputSize = 7, hiddenSize = 0, outputSize = 1;
  for (int index = 1; index < argc; ++index) {
    std::string argument = argv[index];
    if (argument == "--input-size" || argument == "--hidden-size" || argument == "--output-size") {
      if (index + 1 >= argc) return fail(argument + " needs a value; " + usage);
      std::string value = argv[++index];
      int& size = argument == "--input-size" ? inputSize : argument == "--hidden-size" ? hiddenSize : outputSize;
      if (!size_flag(value, size)) return fail(argument + " " + value + " is not a number >= 1; " + usage);
    } else if (argument.rfind("--", 0) == 0) {
      return fail("unknown option " + argument + "; " + usage);
    } else {
      positional.push_back(argument);
    }
  }
  if (positional.size() != 2 || hiddenSize == 0) return fail(usage);
  if (outputSize != 1) return fail("--output-size " + std::to_string(outputSize) + ": IceNet's jac is one output's");
  const std::string modelFileName = positional[0], csv_path = positional[1];

  // BaseEmul.h's constructor: make_shared<Net>(...), initWeights(), then "load model": torch::load, loadNorm
  auto model_ = std::make_shared<IceNet>(inputSize, hiddenSize, outputSize, 1, 1);
  model_->initWeights();
  try {
    torch::load(model_, modelFileName);
    model_->loadNorm(modelFileName);
  } catch (const std::exception& error) {
    return fail(modelFileName + " does not load as SOCA's BaseEmul loads IceNet (torch::load, loadNorm): " +
                first_line(error.what()));
  }

  std::vector<std::vector<double>> points;
  if (auto error = read_rows(csv_path, static_cast<size_t>(inputSize), "IceNet", points); !error.empty())
    return fail(error);

  std::string header = "aice";
  for (int i = 0; i < inputSize; ++i)
    header += ",daice_d" + (inputSize == 7 ? std::string(kInputs[i]) : "x" + std::to_string(i));
  std::cout << header << "\n";

  // IceEmul.h predict: one float32 point at a time, forward, then jac
  torch::Tensor input = torch::ones({inputSize});
  try {
    for (const auto& point : points) {
      for (int i = 0; i < inputSize; ++i) input[i] = point[i];
      torch::Tensor prediction = model_->forward(input);
      std::string text = number(prediction.item<float>());
      torch::Tensor doutdx = model_->jac(input);
      for (int i = 0; i < inputSize; ++i) text += "," + number(doutdx[i].item<float>());
      std::cout << text << "\n";
    }
  } catch (const std::exception& error) {
    return fail("IceNet's forward or jac failed on " + modelFileName + ": " + first_line(error.what()));
  }
  return 0;
}
